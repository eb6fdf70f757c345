"""The evaluation loop: tasks x (unmodified, then every mode x cluster count x seed), with progress reporting.

A ``TaskSession`` loads one task's model and examples once and scores any configuration on them, scores
and speed together (``TaskSession.score``: what a tuner calls candidate after candidate, reusing the
unmodified run). ``run_plan`` drives a session per task; a task that fails is recorded with its error and
the loop goes on to the next one. Under ``accelerate launch`` every process runs this loop in step (the
batches are shared out by ``parallel.Workers``); only the main process reports.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from bert_cluster import hf
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError, one_line, positive_int
from bert_cluster.evaluation.report import Results, RunResult, TaskResult
from bert_cluster.parallel import Timing, Workers
from bert_cluster.reports import environment
from bert_cluster.tasks.config import TaskConfig
from bert_cluster.tasks.kinds import Examples, LoadedModel, ScoreSettings, TaskKind, get_kind


class Reporter(Protocol):
    """What the runner tells about its progress (the CLI renders it; the API default is silent)."""

    def start(self, tasks: int) -> None:
        """The run begins with ``tasks`` tasks."""

    def task(self, name: str, configurations: int) -> None:
        """A task begins; it has ``configurations`` runs (unmodified included)."""

    def configuration(self, label: str) -> None:
        """A configuration of the current task begins."""

    def advance(
        self, done: int, total: int, tokens: int | None = None, tokens_total: int | None = None
    ) -> None:
        """``done`` of ``total`` items of the current configuration are scored (this process's share).

        ``tokens`` of ``tokens_total``: their tokens, what the time left is weighted by (absent from a
        kind that runs its own loop). ``tokens == 0`` starts a model pass: its clock starts there.
        """

    def configuration_done(self, run: RunResult) -> None:
        """The current configuration is scored."""

    def task_done(self, result: TaskResult) -> None:
        """The current task is finished (ok, failed or interrupted)."""

    def finish(self) -> None:
        """The run is over."""


class SilentReporter:
    """Reports nothing (the API's default, and every process but the main one)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: carries the results measured so far (the interrupted task marked so)."""

    def __init__(self, results: Results) -> None:
        super().__init__("interrupted")
        self.results = results
        self.written: Path | None = None  # the results.json holding them, once written


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Everything one run needs, validated: what ``evaluate`` builds from its arguments."""

    model: str  # may hold "{task}", replaced by each task's name
    tasks: tuple[TaskConfig, ...]
    clusters: tuple[int, ...]
    seeds: tuple[int, ...]
    attention: ClusteredAttentionConfig
    modes: tuple[str, ...] = ()  # () : the attention config's mode only
    data_dirs: tuple[Path, ...] = ()
    limit: int | None = None
    batch_size: int | None = None
    max_length: int | None = None
    device: str = "cpu"

    def model_for(self, task: TaskConfig) -> str:
        """The model path of ``task`` (``{task}`` in the path is replaced by the task name)."""
        return self.model.replace("{task}", task.name)

    def configurations(self) -> list[ClusteredAttentionConfig]:
        """Every patched configuration, in run order: mode, then C, then seed."""
        return [
            self.attention.replace(mode=mode, clusters=clusters, seed=seed)
            for mode in self.modes or (self.attention.mode,)
            for clusters in self.clusters
            for seed in self.seeds
        ]

    def settings(self) -> dict[str, Any]:
        """The JSON-ready settings recorded in results.json."""
        return {
            "model": self.model,
            "tasks": [task.name for task in self.tasks],
            "clusters": list(self.clusters),
            "modes": list(self.modes or (self.attention.mode,)),
            "seeds": list(self.seeds),
            "attention": {k: v for k, v in self.attention.to_dict().items() if k not in ("clusters", "seed")},
            "data_dirs": [str(folder) for folder in self.data_dirs],
            "limit": self.limit,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "device": self.device,
        }


def attention_backend(config: ClusteredAttentionConfig, device: str) -> str:
    """The backend ``config`` runs on ``device`` (``BERT_CLUSTER_BACKEND`` included).

    Raises:
        UserError: a forced backend that cannot run here, or a bad ``BERT_CLUSTER_BACKEND``.
    """
    import torch

    from bert_cluster import dispatch

    probe = torch.zeros(1, 1, 2, 8, device=device)
    try:
        return dispatch.select_backend(config.backend, probe, probe, probe).name
    except ValueError as error:
        raise UserError(one_line(error)) from None


def unpatch(loaded: LoadedModel) -> dict[str, Any] | None:
    """Revert a checkpoint saved converted, so that "unmodified" means its original attention.

    ``finetune``'s output (or ``convert`` then ``save_pretrained``) reloads converted; scored as loaded, its
    unmodified run would be its saved clustered settings. Returns those settings (None: not converted); the
    task's notes name them.
    """
    settings = getattr(getattr(loaded.target, "config", None), hf.SETTINGS_KEY, None)
    if not isinstance(settings, dict):
        return None
    hf.revert(loaded.target)
    mode, clusters = settings.get("mode", "?"), settings.get("clusters", "?")
    note = f"{mode} C={clusters}, scored unmodified as {settings.get('original_attn_implementation', 'sdpa')}"
    loaded.extra.setdefault("notes", {})["saved converted"] = note
    return settings


class TaskSession:
    """One task's model and examples, loaded once, and the scoring of any configuration on them."""

    def __init__(
        self,
        task: TaskConfig,
        model: str,
        *,
        data_dirs: Sequence[Path] = (),
        limit: int | None = None,
        batch_size: int | None = None,
        max_length: int | None = None,
        device: str = "cpu",
        workers: Workers | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        """Load the task's examples, then its model, and check ``max_length`` against the model.

        Raises:
            UserError: a task file that does not suit its kind, missing data, an unfitting model.
        """
        self.task, self.model = task, model
        self.workers = workers or Workers(device)
        self.reporter = reporter or SilentReporter()
        self.kind: TaskKind = get_kind(task)
        self.examples: Examples = self.kind.load_examples(task, list(data_dirs) or None, limit)
        device = self.workers.device(device)
        self.loaded: LoadedModel = self.kind.load_model(model, task, device)
        self.saved_patched = unpatch(self.loaded)
        positions = self.loaded.max_positions
        if max_length is not None and positions is not None and max_length > positions:
            raise UserError(
                f"--max-length {max_length} is more than model {model} takes ({positions} positions)"
            )
        self.settings = ScoreSettings(
            batch_size=batch_size or task.batch_size,
            max_length=max_length,
            device=device,
            workers=self.workers,
        )
        self.unmodified: RunResult | None = None

    def score(self, config: ClusteredAttentionConfig | None) -> RunResult:
        """Scores and speed of ``config`` (None: the unmodified model); the model is reverted afterwards.

        The first call should be the unmodified one: later runs get their speedup against it.
        """
        workers, target = self.workers, self.loaded.target
        workers.timing = Timing()
        label = "unmodified" if config is None else f"{config.mode} C={config.clusters} seed={config.seed}"
        self.reporter.configuration(label)
        if config is None:
            backend = str(getattr(getattr(target, "config", None), "_attn_implementation", None) or "eager")
        else:
            backend = attention_backend(config, self.settings.device)
            hf.convert(target, config=config)
        try:
            began = time.perf_counter()
            scores = self.kind.score(
                self.loaded, self.task, self.examples, self.settings, self.reporter.advance
            )
            elapsed = time.perf_counter() - began
        finally:
            if config is not None:
                hf.revert(target)
        timing = workers.combined_timing()
        if timing.items == 0:  # a kind that runs its own loop: timed as a whole, tokens unknown
            timing = Timing(seconds=max(workers.gather([elapsed])), tokens=0)
        seconds = max(timing.seconds, 1e-9)
        run = RunResult(
            clusters=None if config is None else config.clusters,
            seed=None if config is None else config.seed,
            scores={name: float(value) for name, value in scores.items()},
            wall_time_s=timing.seconds,
            examples_per_s=self.examples.count / seconds,
            tokens_per_s=timing.tokens / seconds if timing.tokens else None,
            speedup=1.0
            if config is None
            else (self.unmodified.wall_time_s / seconds if self.unmodified else None),
            backend=backend,
            mode=None if config is None else config.mode,
            processes=workers.count,
            attention=None if config is None else config.to_dict(),
        )
        if config is None:
            self.unmodified = run
        self.reporter.configuration_done(run)
        return run


def run_task(
    plan: RunPlan,
    task: TaskConfig,
    reporter: Reporter,
    workers: Workers,
    on_run: Callable[[TaskResult], None] | None = None,
) -> TaskResult:
    """Score one task in every configuration; failures are recorded, not raised (Ctrl-C is re-raised).

    ``on_run`` is called with the task's results so far after each configuration (partial results.json).
    """
    on_run = on_run or (lambda result: None)
    result = TaskResult(
        task=task.name,
        kind=task.kind,
        version=task.version,
        metrics=[(m.name, m.display) for m in task.metrics],
        config=task.to_dict(),
        model=plan.model_for(task),
    )
    configurations = plan.configurations()
    reporter.task(task.name, 1 + len(configurations))
    try:
        session = TaskSession(
            task,
            plan.model_for(task),
            data_dirs=plan.data_dirs,
            limit=plan.limit,
            batch_size=plan.batch_size,
            max_length=plan.max_length,
            device=plan.device,
            workers=workers,
            reporter=reporter,
        )
        result.source, result.examples = session.examples.source, session.examples.count
        result.notes = {**session.examples.notes, **session.loaded.extra.get("notes", {})}
        for config in [None, *configurations]:
            result.runs.append(session.score(config))
            on_run(result)
    except KeyboardInterrupt:
        result.status, result.error = (
            "interrupted",
            f"interrupted (Ctrl-C) after {len(result.runs)} configuration(s)",
        )
        on_run(result)
        reporter.task_done(result)
        raise
    except UserError as error:
        result.status, result.error = "failed", one_line(error)
    except Exception as error:  # noqa: BLE001 - one task's crash must not lose the others' results
        where = traceback.extract_tb(error.__traceback__)[-1]
        result.status = "failed"
        result.error = (
            f"{type(error).__name__}: {one_line(error)} (at {Path(where.filename).name}:{where.lineno})"
        )
    reporter.task_done(result)
    return result


def run_plan(
    plan: RunPlan,
    reporter: Reporter | None = None,
    partial: Callable[[Results], None] | None = None,
    workers: Workers | None = None,
) -> Results:
    """Run every task of ``plan`` and collect the results (the environment is recorded too).

    ``partial`` receives the results so far (``complete`` False) after every configuration, so a long
    run that is stopped still leaves what it measured.

    Raises:
        RunInterrupted: Ctrl-C; it carries the results so far, the current task marked interrupted.
    """
    workers = workers or Workers(plan.device)
    reporter = reporter if reporter is not None and workers.is_main else SilentReporter()
    began = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    env = environment(workers.device(plan.device), workers.count)
    tasks: list[TaskResult] = []
    current: list[TaskResult] = []

    def snapshot(complete: bool) -> Results:
        return Results(
            tasks=[*tasks, *current],
            settings=plan.settings(),
            environment=env,
            started=started,
            wall_time_s=time.perf_counter() - began,
            complete=complete,
        )

    def on_run(result: TaskResult) -> None:
        current[:] = [result]
        if partial is not None:
            partial(snapshot(False))

    reporter.start(len(plan.tasks))
    try:
        for task in plan.tasks:
            tasks.append(run_task(plan, task, reporter, workers, on_run))
            current.clear()
    except KeyboardInterrupt:
        raise RunInterrupted(snapshot(False)) from None
    finally:
        reporter.finish()
    return snapshot(True)


def parse_seeds(value: int | Sequence[int]) -> tuple[int, ...]:
    """``N`` means seeds 0..N-1; a sequence is taken as the seeds themselves."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        seeds = tuple(value)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
            raise UserError(f"seeds must be a positive count or a list of non-negative ints, got {value!r}")
        return tuple(dict.fromkeys(seeds))
    return tuple(range(positive_int("seeds", value)))
