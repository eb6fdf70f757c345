"""Trainer callbacks: the progress reporter told each step (a bar with an ETA), and the training clock."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState


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


class TrainingClock(TrainerCallback, ExportableState):
    """Seconds of training over every part of a run, saved in each checkpoint's ``trainer_state.json``.

    Trainer's own ``train_runtime`` counts one ``train()`` call: after a resume it was the last part's time
    only (a SQuAD run resumed at step 100 of 367 reported 1,146 s for the 267 steps left). A checkpoint
    records the time up to its step, and the resumed run adds its own to that: the steps redone after a
    kill count once, the time lost to them not at all.
    """

    def __init__(self, seconds_before: float = 0.0) -> None:
        self.seconds_before = seconds_before
        self.started: float | None = None

    @classmethod
    def resuming(cls, checkpoint: Path | None) -> TrainingClock:
        """A clock going on from ``checkpoint``'s time (0 without one, or if the checkpoint has none)."""
        if checkpoint is None:
            return cls()
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        saved = state.get("stateful_callbacks", {}).get(cls.__name__, {})
        return cls(float(saved.get("attributes", {}).get("seconds_before", 0.0)))

    @property
    def seconds(self) -> float:
        """Training time so far, over all parts."""
        running = 0.0 if self.started is None else time.monotonic() - self.started
        return self.seconds_before + running

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.started = time.monotonic()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.seconds_before, self.started = self.seconds, None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the time up to it, under the name a resumed clock reads back."""
        return {"args": {}, "attributes": {"seconds_before": round(self.seconds, 3)}}
