"""Trainer callbacks: progress (a bar with an ETA), the training clock, and the run's safety (``safety``).

The guard that stops at a non-finite step, the checkpoints' checksums, and no step past the last on a
resume from it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from bert_cluster.finetuning import safety


class ProgressCallback(TrainerCallback):
    """``reporter`` (``evaluation.runner.Reporter``'s methods) as one task with one configuration.

    The ETA counts the steps of this process only: after a resume, the steps already done do not make
    the rest look faster.
    """

    def __init__(self, reporter: Any, task: str, label: str, budget: tuple[Any, float] | None = None) -> None:
        self.reporter, self.task, self.label = reporter, task, label
        self.start: int | None = None
        self.budget = budget  # (TrainingClock, seconds): a time budget, counted in seconds of training

    def _counts(self, state: Any) -> tuple[int, int]:
        """(done, total): steps, or with a time budget whole seconds of training."""
        if self.budget is None:
            return state.global_step, state.max_steps
        clock, seconds = self.budget  # the budget is the clock: what is left of it is the ETA
        return min(int(clock.seconds), int(seconds)), int(seconds)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.reporter.start(1)
        self.reporter.task(self.task, 1)
        self.reporter.configuration(self.label)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        done, total = self._counts(state)
        if self.start is None:  # this process's first step (after a resume: the checkpoint's + 1)
            self.start = state.global_step - 1 if self.budget is None else done
            self.reporter.advance(self.start, total, 0, total - self.start)
        self.reporter.advance(done, total, done - self.start, total - self.start)

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
        self.excluded = 0.0  # this part's seconds spent scoring (``paused``): not training time

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
        running = 0.0 if self.started is None else time.monotonic() - self.started - self.excluded
        return self.seconds_before + running

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside (scoring the held-out split) is not training time."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.excluded += time.monotonic() - began

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.started, self.excluded = time.monotonic(), 0.0

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self.seconds_before, self.started = self.seconds, None

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        logs = kwargs.get("logs") or {}
        if "loss" in logs and state.log_history:  # the loss curve against training time too
            state.log_history[-1]["seconds"] = round(self.seconds, 3)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the time up to it, under the name a resumed clock reads back."""
        return {"args": {}, "attributes": {"seconds_before": round(self.seconds, 3)}}


class FiniteGuard(TrainerCallback):
    """Stop at the first step whose loss or gradient norm is not finite, before anything of it is saved.

    Run with Trainer's ``logging_nan_inf_filter`` off and a log every step, so that the logged loss is the
    step's own (the filter logs the mean of the earlier ones in its place: "last loss 0.0000" from a run
    whose weights were all NaN). A step whose checkpoint is due is also checked for non-finite trained
    weights (an update can overflow with a finite loss and gradient). ``stopped``: (step, what) or None.
    """

    def __init__(self) -> None:
        self.stopped: tuple[int, str] | None = None

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        bad = safety.non_finite(kwargs.get("logs") or {})
        model = kwargs.get("model")
        if not bad and control.should_save and model is not None and not safety.finite_parameters(model):
            bad = ["a trained weight is not finite"]
        if bad:
            self.stopped = (state.global_step, " and ".join(bad))
            control.should_training_stop = True
            control.should_save = False


class CheckpointChecksums(TrainerCallback):
    """After Trainer saved a checkpoint, a sha256 of each of its files in it (``safety.CHECKSUMS``)."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            safety.write_checksums(checkpoint)


class _AtTheEnd(Exception):
    """Raised by ``StopAtTheEnd``: the checkpoint resumed from is the run's last step."""


class StopAtTheEnd(TrainerCallback):
    """A resume from a checkpoint at the run's last step trains nothing (Trainer would run one step more).

    Trainer loads the checkpoint, then starts the epoch the checkpoint is in; where ``max_steps`` is not a
    whole number of epochs it runs that epoch's next batch before it checks the step count (a run of
    ``max_steps`` 6 resumed from checkpoint-6 reported 7 steps). Stopping at ``on_train_begin`` leaves the
    model and the state as the checkpoint holds them; ``finished`` says it happened.
    """

    Stop = _AtTheEnd

    def __init__(self) -> None:
        self.finished = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            self.finished = True
            raise _AtTheEnd


class TrainingMarks(TrainerCallback, ExportableState):
    """The held-out split scored at marks of training time, and the run stopped at its time budget.

    The clock (``TrainingClock``) is paused while scoring, so the budget and the marks count training
    alone. A mark of 0 is scored before the first step. ``evaluations``: one entry per mark passed (the
    seconds and step it was scored at, and what ``score`` returns: ``scores``, maybe ``exact_attention``);
    saved in each checkpoint, so that a resumed run keeps the marks scored before and scores only those
    after.
    """

    def __init__(
        self,
        clock: TrainingClock,
        marks: Sequence[float],
        budget: float | None,
        score: Callable[[], dict[str, Any]],
        evaluations: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.clock, self.budget, self.score = clock, budget, score
        self.evaluations = list(evaluations)
        done = {entry["mark"] for entry in self.evaluations}
        self.pending = sorted(mark for mark in marks if mark not in done)

    @staticmethod
    def saved(checkpoint: Path | None) -> list[dict[str, Any]]:
        """The evaluations a checkpoint holds (none without one)."""
        if checkpoint is None:
            return []
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        saved = state.get("stateful_callbacks", {}).get(TrainingMarks.__name__, {})
        return list(saved.get("attributes", {}).get("evaluations", []))

    def _score_due(self, step: int, model: Any) -> None:
        while self.pending and self.clock.seconds >= self.pending[0]:
            mark, seconds = self.pending.pop(0), self.clock.seconds
            with self.clock.paused():
                training = getattr(model, "training", False)
                scored = self.score()
                if training:
                    model.train()
            self.evaluations.append({"mark": mark, "seconds": seconds, "step": step, **scored})

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        if state.global_step == 0:
            self._score_due(0, kwargs.get("model"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: D102
        self._score_due(state.global_step, kwargs.get("model"))
        if self.budget is not None and self.clock.seconds >= self.budget:
            control.should_training_stop = True

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the marks scored so far."""
        return {"args": {}, "attributes": {"evaluations": self.evaluations}}
