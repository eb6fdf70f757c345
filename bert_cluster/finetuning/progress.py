"""The Trainer callback that tells the project's progress reporter each step (a bar with an ETA)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


class ProgressCallback(TrainerCallback):
    """``reporter`` (``evaluation.runner.Reporter``'s methods) as one task with one configuration.

    The ETA counts the steps of this process only: after a resume, the steps already done do not make
    the rest look faster.
    """

    def __init__(self, reporter: Any, task: str, label: str) -> None:
        self.reporter, self.task, self.label = reporter, task, label
        self.start: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.reporter.start(1)
        self.reporter.task(self.task, 1)
        self.reporter.configuration(self.label)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        total = state.max_steps
        if self.start is None:  # this process's first step (after a resume: the checkpoint's + 1)
            self.start = state.global_step - 1
            self.reporter.advance(self.start, total, 0, total - self.start)
        self.reporter.advance(state.global_step, total, state.global_step - self.start, total - self.start)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.reporter.finish()
