"""The evaluation loop: tasks x (unmodified, then every cluster count x seed), with progress reporting.

Each task loads its model and examples once through its kind, scores the unmodified model, then for
each configuration calls ``bert_cluster.convert``, scores, and ``bert_cluster.revert``. A task that
fails is recorded with its error and the loop goes on to the next one.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import bert_cluster
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.kinds import KINDS, ScoreSettings, TaskKind
from bert_cluster.evaluation.report import Results, RunResult, TaskResult, environment
from bert_cluster.evaluation.tasks import TaskConfig

#: Modules whose import registers task kinds; the embedding kinds are the demo's and optional.
_KIND_MODULES = (
    "bert_cluster.evaluation.classification",
    "bert_cluster.evaluation.squad",
    "bert_cluster.evaluation.embedding",
    "bert_cluster.evaluation.long_documents",
)


def load_kinds() -> dict[str, TaskKind]:
    """Import every module that registers kinds and return the registry."""
    for module in _KIND_MODULES:
        importlib.import_module(module)
    return KINDS


class Reporter(Protocol):
    """What the runner tells about its progress (the CLI shows rich bars; the API default is silent)."""

    def start(self, tasks: int) -> None:
        """The run begins with ``tasks`` tasks."""

    def task(self, name: str, configurations: int) -> None:
        """A task begins; it has ``configurations`` runs (unmodified included)."""

    def configuration(self, label: str) -> None:
        """A configuration of the current task begins."""

    def advance(self, done: int, total: int) -> None:
        """``done`` of ``total`` batches' items of the current configuration are scored."""

    def configuration_done(self, run: RunResult) -> None:
        """The current configuration is scored."""

    def task_done(self, result: TaskResult) -> None:
        """The current task is finished (ok or failed)."""

    def finish(self) -> None:
        """The run is over."""


class SilentReporter:
    """Reports nothing."""

    def start(self, tasks: int) -> None:  # noqa: D102
        pass

    def task(self, name: str, configurations: int) -> None:  # noqa: D102
        pass

    def configuration(self, label: str) -> None:  # noqa: D102
        pass

    def advance(self, done: int, total: int) -> None:  # noqa: D102
        pass

    def configuration_done(self, run: RunResult) -> None:  # noqa: D102
        pass

    def task_done(self, result: TaskResult) -> None:  # noqa: D102
        pass

    def finish(self) -> None:  # noqa: D102
        pass


class RichReporter:
    """Three rich progress bars (tasks, configurations of the task, items of the configuration)."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description:<32}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._tasks = self._configs = self._items = None

    def start(self, tasks: int) -> None:  # noqa: D102
        self.progress.start()
        self._tasks = self.progress.add_task("tasks", total=tasks)

    def task(self, name: str, configurations: int) -> None:  # noqa: D102
        if self._configs is not None:
            self.progress.remove_task(self._configs)
        self._configs = self.progress.add_task(f"{name}: configurations", total=configurations)
        self.progress.update(self._tasks, description=f"tasks ({name})")

    def configuration(self, label: str) -> None:  # noqa: D102
        if self._items is not None:
            self.progress.remove_task(self._items)
        self._items = self.progress.add_task(f"  {label}", total=None)

    def advance(self, done: int, total: int) -> None:  # noqa: D102
        self.progress.update(self._items, completed=done, total=total)

    def configuration_done(self, run: RunResult) -> None:  # noqa: D102
        self.progress.advance(self._configs)

    def task_done(self, result: TaskResult) -> None:  # noqa: D102
        self.progress.advance(self._tasks)

    def finish(self) -> None:  # noqa: D102
        self.progress.stop()


class LineReporter(SilentReporter):
    """One plain line per finished configuration and task: for logs, where progress bars cannot redraw."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream
        self.name = ""

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def task(self, name: str, configurations: int) -> None:  # noqa: D102
        self.name = name
        self._print(f"[{name}] {configurations} configuration(s)")

    def configuration_done(self, run: RunResult) -> None:  # noqa: D102
        scores = ", ".join(f"{key} {value:.2f}" for key, value in run.scores.items())
        self._print(
            f"[{self.name}] {run.label}: {scores} ({run.wall_time_s:.1f} s, {run.examples_per_s:.1f}/s)"
        )

    def task_done(self, result: TaskResult) -> None:  # noqa: D102
        state = "ok" if result.ok else f"failed: {result.error}"
        self._print(f"[{result.task}] {state} (data: {result.source})")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Everything one run needs, validated: what ``evaluate`` builds from its arguments."""

    model: str | None  # may hold "{task}", replaced by each task's name
    tasks: tuple[TaskConfig, ...]
    clusters: tuple[int, ...]
    seeds: tuple[int, ...]
    attention: ClusteredAttentionConfig
    data_dirs: tuple[Path, ...] = ()
    limit: int | None = None
    batch_size: int | None = None
    max_length: int | None = None
    device: str = "cpu"

    def model_for(self, task: TaskConfig) -> str:
        """The model path of ``task`` (``{task}`` in the path is replaced by the task name)."""
        assert self.model is not None
        return self.model.replace("{task}", task.name)

    def settings(self) -> dict[str, Any]:
        """The JSON-ready settings recorded in results.json."""
        return {
            "model": self.model,
            "tasks": [task.name for task in self.tasks],
            "clusters": list(self.clusters),
            "seeds": list(self.seeds),
            "mode": self.attention.mode,
            "attention": {k: v for k, v in self.attention.to_dict().items() if k not in ("clusters", "seed")},
            "data_dirs": [str(folder) for folder in self.data_dirs],
            "limit": self.limit,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "device": self.device,
        }


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


def _score(
    kind: TaskKind,
    loaded: Any,
    task: TaskConfig,
    examples: Any,
    settings: ScoreSettings,
    reporter: Reporter,
    clusters: int | None,
    seed: int | None,
    attention: ClusteredAttentionConfig | None,
) -> RunResult:
    reporter.configuration("unmodified" if clusters is None else f"C={clusters} seed={seed}")
    began = time.perf_counter()
    scores = kind.score(loaded, task, examples, settings, reporter.advance)
    elapsed = time.perf_counter() - began
    run = RunResult(
        clusters=clusters,
        seed=seed,
        scores={k: float(v) for k, v in scores.items()},
        wall_time_s=elapsed,
        examples_per_s=examples.count / elapsed if elapsed > 0 else float("inf"),
        attention=None if attention is None else attention.to_dict(),
    )
    reporter.configuration_done(run)
    return run


def run_task(
    plan: RunPlan, task: TaskConfig, reporter: Reporter, on_run: Callable[[TaskResult], None] | None = None
) -> TaskResult:
    """Score one task in every configuration; failures are recorded, not raised.

    ``on_run`` is called with the task's results so far after each configuration (partial results.json).
    """
    on_run = on_run or (lambda result: None)
    result = TaskResult(
        task=task.name,
        kind=task.kind,
        version=task.version,
        metrics=[(m.name, m.display) for m in task.metrics],
        config=task.to_dict(),
    )
    configurations = 1 + len(plan.clusters) * len(plan.seeds)
    reporter.task(task.name, configurations)
    try:
        kinds = load_kinds()
        if task.kind not in kinds:
            raise UserError(
                f"task {task.name} has kind {task.kind!r}, which no module registers; "
                f"known kinds: {', '.join(sorted(kinds))}"
            )
        kind = kinds[task.kind]
        result.model = plan.model_for(task)
        examples = kind.load_examples(task, list(plan.data_dirs) or None, plan.limit)
        result.source, result.examples = examples.source, examples.count
        loaded = kind.load_model(result.model, task, plan.device)
        settings = ScoreSettings(
            batch_size=plan.batch_size or task.batch_size, max_length=plan.max_length, device=plan.device
        )
        result.runs.append(_score(kind, loaded, task, examples, settings, reporter, None, None, None))
        on_run(result)
        for clusters in plan.clusters:
            for seed in plan.seeds:
                config = plan.attention.replace(clusters=clusters, seed=seed)
                bert_cluster.convert(loaded.model, config=config)
                try:
                    result.runs.append(
                        _score(kind, loaded, task, examples, settings, reporter, clusters, seed, config)
                    )
                finally:
                    bert_cluster.revert(loaded.model)
                on_run(result)
    except UserError as error:
        result.status, result.error = "failed", _one_line(error)
    except Exception as error:  # noqa: BLE001 - one task's crash must not lose the others' results
        where = traceback.extract_tb(error.__traceback__)[-1]
        result.status = "failed"
        result.error = (
            f"{type(error).__name__}: {_one_line(error)} (at {Path(where.filename).name}:{where.lineno})"
        )
    reporter.task_done(result)
    return result


def run_plan(
    plan: RunPlan, reporter: Reporter | None = None, partial: Callable[[Results], None] | None = None
) -> Results:
    """Run every task of ``plan`` and collect the results (the environment is recorded too).

    ``partial`` receives the results so far (``complete`` False) after every configuration, so a long
    run that is stopped still leaves what it measured.
    """
    reporter = reporter or SilentReporter()
    began = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    env = environment(plan.device)
    tasks: list[TaskResult] = []

    def snapshot(current: TaskResult | None, complete: bool) -> Results:
        return Results(
            tasks=[*tasks, *([current] if current is not None else [])],
            settings=plan.settings(),
            environment=env,
            started=started,
            wall_time_s=time.perf_counter() - began,
            complete=complete,
        )

    on_run = None if partial is None else (lambda current: partial(snapshot(current, False)))
    reporter.start(len(plan.tasks))
    try:
        for task in plan.tasks:
            tasks.append(run_task(plan, task, reporter, on_run))
    finally:
        reporter.finish()
    return snapshot(None, True)


def parse_clusters(value: int | str | Sequence[int | str]) -> tuple[int, ...]:
    """Cluster counts from ``25``, ``"10,25,50"`` or ``[10, 25]``: positive ints, duplicates dropped."""
    if isinstance(value, bool):
        raise UserError(f"clusters must be positive ints, got {value!r}")
    parts: list[Any]
    if isinstance(value, int):
        parts = [value]
    elif isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
    else:
        parts = list(value)
    counts = []
    for part in parts:
        text = str(part).strip()
        if isinstance(part, bool) or not text.isdigit() or int(text) < 1:
            raise UserError(
                f"malformed cluster list {value!r}: give positive ints separated by commas, e.g. 10,25,50"
            )
        counts.append(int(text))
    if not counts:
        raise UserError("the cluster list is empty: give positive ints separated by commas, e.g. 10,25,50")
    return tuple(dict.fromkeys(counts))


def parse_seeds(value: int | Sequence[int]) -> tuple[int, ...]:
    """``N`` means seeds 0..N-1; a sequence is taken as the seeds themselves."""
    if isinstance(value, bool):
        raise UserError(f"seeds must be a positive count or a list of seeds, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise UserError(f"seeds must be a positive count, got {value}")
        return tuple(range(value))
    seeds = tuple(value)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise UserError(f"seeds must be a positive count or a list of non-negative ints, got {value!r}")
    return tuple(dict.fromkeys(seeds))


def check_device(device: str) -> str:
    """``cpu`` or ``cuda[:N]`` with a GPU present."""
    import torch

    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r} asked for, but torch sees no CUDA GPU here; use --device cpu")
        return device
    raise UserError(f"device must be cpu or cuda (or cuda:N), got {device!r}")
