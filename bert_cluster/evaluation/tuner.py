"""Find the cheapest clustered-attention settings that keep a task's score within a budget.

``tune`` scores a checkpoint unmodified once, then candidate settings (mode, C, k, layers) one at a time
on the same dev slice through ``TaskSession.score``, and keeps the cheapest candidate whose score change
stays within ``budget`` points on every judged metric. It is cheap because it assumes what the
approximation does monotonically: more clusters C, more exact keys k and fewer patched layers never make
the score worse. So it walks the frontier of the (C, k) grid (C from the largest down, stopping at the
first C that fails; at a larger k only the C below the last one that passed, since the others are
dominated), binary-searches how many layers, counted from the first or from the last, the failing
candidate nearest to the budget can patch, and can screen each candidate on the slice's first examples
first, dropping those far out of budget before the full slice.

Cheapest means, by default (``cost="attention"``), the lowest value of the attention cost model
``attention_cost``: per query, C + k key dot products in a patched layer against n in an exact one (n:
the slice's mean row length), averaged over the layers. It ignores hashing, K-means and everything
outside attention, but it gives the same choice on every machine and under any load. With
``cost="speed"`` it is the highest speedup measured on the slice (the unmodified model's wall time over
the candidate's, the same batches after a warm-up batch, as ``evaluate`` reports it): the truth on a
quiet machine, noise on a busy one. Both are reported for every candidate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bert_cluster import config as presets
from bert_cluster import hf, reports
from bert_cluster.attention import clustered_attention
from bert_cluster.checkpoints import attention_config, check_model_path, convert_checkpoint, resolve_model
from bert_cluster.config import MODES, ClusteredAttentionConfig
from bert_cluster.errors import UserError, one_line, parse_clusters, positive_int
from bert_cluster.evaluation import runner
from bert_cluster.evaluation.report import RunResult
from bert_cluster.parallel import Workers, check_device
from bert_cluster.reports import ReportFiles, atomic_write, markdown_table, metadata_markdown, write_report
from bert_cluster.tasks.config import get_tasks
from bert_cluster.tasks.data import data_dirs

#: The default grid: cluster counts C and exact keys k tried (the product's C = 25, k = 32 included).
DEFAULT_CLUSTERS = (10, 25, 50, 100)
DEFAULT_TOPK = (16, 32, 64)
#: What "cheapest" is measured by: the measured speedup, or the attention cost model.
COSTS = ("speed", "attention")
#: Screening with screen="auto": the first quarter of a slice of at least this many examples.
AUTO_SCREEN_MIN = 200
#: The files a tuning run writes into its output folder (and the only ones --overwrite removes).
TUNE_FILES = ReportFiles("tune.json", "tune.md", "tune.png", extra=("clustered-attention.json",))
FILES = TUNE_FILES.names
SCHEMA_VERSION = 1
_SLACK = 1e-9  # a change of exactly -budget is within budget (float sums of per-example scores)


@dataclasses.dataclass
class Candidate:
    """One setting tried: its verdict, its runs and what it costs.

    Attributes:
        config: the settings scored (``ClusteredAttentionConfig``).
        stage: ``grid`` (all layers, a point of the C x k grid) or ``layers`` (a prefix or a suffix).
        status: ``in budget``, ``over budget`` or ``screened out`` (far out of budget on the first
            examples, not scored on the whole slice).
        changes: per judged metric, the mean score change over the seeds in points (on the screening
            chunk for a screened-out candidate).
        speedup: mean measured speedup over the unmodified model (None when screened out).
        cost: the attention cost model's value, relative to exact attention (1.0).
        runs: the full-slice runs, one per seed; ``screen``: the screening run, if any.
    """

    config: ClusteredAttentionConfig
    stage: str
    status: str
    changes: dict[str, float]
    speedup: float | None
    cost: float
    runs: list[RunResult] = dataclasses.field(default_factory=list)
    screen: RunResult | None = None
    uses_topk: bool = True  # False for a mode whose output does not depend on k

    @property
    def ok(self) -> bool:
        """True when the candidate stayed within budget on every judged metric."""
        return self.status == "in budget"

    @property
    def layers_label(self) -> str:
        """``all``, or the patched layers as a range (``0-3``) or a list."""
        layers = self.config.layers
        if layers is None:
            return "all"
        if len(layers) > 1 and list(layers) == list(range(layers[0], layers[-1] + 1)):
            return f"{layers[0]}-{layers[-1]}"
        return ",".join(str(index) for index in layers)

    @property
    def label(self) -> str:
        """``i-clustered C=25 k=32 layers=all`` (``clustered C=25 layers=all``: no k)."""
        topk = f" k={self.config.topk}" if self.uses_topk else ""
        return f"{self.config.mode} C={self.config.clusters}{topk} layers={self.layers_label}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (tune.json)."""
        return {
            "label": self.label,
            "stage": self.stage,
            "status": self.status,
            "changes": self.changes,
            "speedup": self.speedup,
            "cost": self.cost,
            "config": self.config.to_dict(),
            "uses_topk": self.uses_topk,
            "runs": [dataclasses.asdict(run) for run in self.runs],
            "screen": None if self.screen is None else dataclasses.asdict(self.screen),
        }


@dataclasses.dataclass
class TuneResult:
    """What ``tune`` found: every candidate tried, in order, and the chosen one (None: keep unmodified)."""

    task: str
    model: str
    budget: float
    metrics: list[tuple[str, str]]  # the judged metrics (name, display)
    cost: str  # what "cheapest" was measured by: "speed" or "attention"
    unmodified: RunResult
    candidates: list[Candidate]
    chosen: Candidate | None
    examples: int
    screen_examples: int | None
    mean_length: float | None
    settings: dict[str, Any]
    environment: dict[str, Any]
    started: str
    wall_time_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def config(self) -> ClusteredAttentionConfig | None:
        """The chosen settings, for ``bert_cluster.convert(model, config=...)`` (None: none in budget)."""
        return None if self.chosen is None else self.chosen.config

    @property
    def recommendation(self) -> str:
        """One sentence: what to use."""
        if self.chosen is None:
            return (
                f"no candidate stays within {self.budget:g} point(s) of the unmodified model on {self.task}: "
                "keep the unmodified model (or raise the budget, or try larger --clusters/--topk)"
            )
        text = f"{self.chosen.label}"
        if self.chosen.speedup is not None:
            text += f" ({self.chosen.speedup:.2f}x the unmodified model's speed"
            text += f", attention cost {self.chosen.cost:.2f})"
        if self.chosen.speedup is not None and self.chosen.speedup < 1.0:
            text += (
                "; it is slower than the unmodified model on this slice and machine (short rows: exact "
                "attention is cheap there), so for speed alone keep the unmodified model"
            )
        return text

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneResult:
        """Read a tune.json document back (``to_dict``'s inverse)."""
        candidates = [
            Candidate(
                config=ClusteredAttentionConfig.from_dict(entry["config"]),
                stage=entry["stage"],
                status=entry["status"],
                changes=dict(entry["changes"]),
                speedup=entry["speedup"],
                cost=entry["cost"],
                runs=[RunResult(**run) for run in entry["runs"]],
                screen=None if entry["screen"] is None else RunResult(**entry["screen"]),
                uses_topk=entry.get("uses_topk", True),
            )
            for entry in data["candidates"]
        ]
        chosen = data.get("chosen")
        return cls(
            task=data["task"],
            model=data["model"],
            budget=data["budget"],
            metrics=[(metric["name"], metric["display"]) for metric in data["metrics"]],
            cost=data["cost"],
            unmodified=RunResult(**data["unmodified"]),
            candidates=candidates,
            chosen=None if chosen is None else candidates[chosen],
            examples=data["examples"],
            screen_examples=data["screen_examples"],
            mean_length=data["mean_length"],
            settings=dict(data["settings"]),
            environment=dict(data["environment"]),
            started=data["started"],
            wall_time_s=data.get("wall_time_s", 0.0),
            notes=list(data.get("notes", [])),
        )

    def to_dict(self) -> dict[str, Any]:
        """The tune.json document."""
        return {
            "schema_version": SCHEMA_VERSION,
            "started": self.started,
            "wall_time_s": self.wall_time_s,
            "task": self.task,
            "model": self.model,
            "budget": self.budget,
            "metrics": [{"name": name, "display": display} for name, display in self.metrics],
            "cost": self.cost,
            "examples": self.examples,
            "screen_examples": self.screen_examples,
            "mean_length": self.mean_length,
            "unmodified": dataclasses.asdict(self.unmodified),
            "candidates": [candidate.to_dict() for candidate in self.candidates],
            "chosen": None if self.chosen is None else self.candidates.index(self.chosen),
            "chosen_config": None if self.config is None else self.config.to_dict(),
            "recommendation": self.recommendation,
            "notes": self.notes,
            "settings": self.settings,
            "environment": self.environment,
        }


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during the search: carries the result over the candidates scored so far (written first)."""

    def __init__(self, result: TuneResult, written: Path | None) -> None:
        super().__init__("interrupted")
        self.result, self.written = result, written


def attention_cost(
    config: ClusteredAttentionConfig, layers: Sequence[int], length: float, topk: bool
) -> float:
    """Attention work relative to exact attention: the mean over ``layers`` of min(1, (C + k) / n).

    Per query, exact attention scores n keys; a patched layer scores C centroids plus k exact keys (k = 0
    for a mode without top-k). Rows of at most C tokens are exact (cost 1).
    """
    if not layers:
        return 1.0
    patched = set(layers) if config.layers is None else set(config.layers) & set(layers)
    work = config.clusters + (config.topk if topk else 0)
    per_layer = 1.0 if length <= config.clusters else min(1.0, work / max(length, 1.0))
    return (len(patched) * per_layer + len(layers) - len(patched)) / len(layers)


def uses_topk(mode: str) -> bool:
    """Whether ``mode``'s output depends on k, probed on a small random input (no list of modes here)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 1, 24, 8, generator=generator) for _ in range(3))
    outputs = [
        clustered_attention(
            query,
            key,
            value,
            config=ClusteredAttentionConfig(clusters=2, topk=k, mode=mode, backend="reference"),
        )
        for k in (1, 12)
    ]
    return not torch.equal(*outputs)


def _numbers(
    name: str, value: int | str | Sequence[int | str] | None, default: Sequence[int]
) -> tuple[int, ...]:

    if value is None:
        return tuple(default)
    try:
        return tuple(sorted(parse_clusters(value)))
    except UserError:
        raise UserError(
            f"malformed {name} list {value!r}: give positive ints separated by commas, e.g. "
            + ",".join(str(number) for number in default)
        ) from None


def _layer_numbers(target: Any) -> list[int] | None:
    """The model's attention layer numbers, or None when its layers share modules (cannot be selected)."""
    models = hf.sentence_transformer_models(target) or [target]
    numbers: set[int] = set()
    for model in models:
        modules = hf.attention_modules(model)
        depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if isinstance(depth, int) and len(modules) < depth:
            return None
        numbers.update(index for _, index in hf.layer_indices(model).values())
    return sorted(numbers) or None


class _Search:
    """The state of one tuning run: the sessions, the candidates tried so far, the verdicts."""

    def __init__(
        self,
        session: Any,
        screen: Any | None,
        metrics: Sequence[str],
        budget: float,
        margin: float,
        seeds: Sequence[int],
        length: float,
        layer_numbers: Sequence[int],
        topk_modes: Mapping[str, bool],
        on_candidate: Callable[[Candidate], None],
    ) -> None:
        self.session, self.screen_session = session, screen
        self.metrics, self.budget, self.margin, self.seeds = list(metrics), budget, margin, list(seeds)
        self.length, self.layer_numbers, self.topk_modes = length, list(layer_numbers), topk_modes
        self.on_candidate = on_candidate
        self.candidates: list[Candidate] = []
        self._seen: dict[ClusteredAttentionConfig, Candidate] = {}

    def changes(self, runs: Sequence[RunResult], base: RunResult) -> dict[str, float]:
        return {
            name: statistics.fmean(run.scores[name] for run in runs) - base.scores[name]
            for name in self.metrics
        }

    def within(self, changes: Mapping[str, float], slack: float = 0.0) -> bool:
        return all(
            not math.isnan(change) and change >= -(self.budget + slack) - _SLACK
            for change in changes.values()
        )

    def try_(self, config: ClusteredAttentionConfig, stage: str) -> Candidate:
        """Score ``config`` (screening first, when on) and record the verdict; a repeat is not rescored."""
        if config in self._seen:
            return self._seen[config]
        topk = self.topk_modes[config.mode]
        cost = attention_cost(config, self.layer_numbers, self.length, topk)
        screened = None
        if self.screen_session is not None:
            screened = self.screen_session.score(config)
            early = self.changes([screened], self.screen_session.unmodified)
            if not self.within(early, self.margin):
                return self._record(
                    Candidate(config, stage, "screened out", early, None, cost, [], screened, topk)
                )
        runs = [self.session.score(config.replace(seed=seed)) for seed in self.seeds]
        changes = self.changes(runs, self.session.unmodified)
        speedups = [run.speedup for run in runs if run.speedup is not None]
        status = "in budget" if self.within(changes) else "over budget"
        speedup = statistics.fmean(speedups) if speedups else None
        return self._record(Candidate(config, stage, status, changes, speedup, cost, runs, screened, topk))

    def _record(self, candidate: Candidate) -> Candidate:
        self._seen[candidate.config] = candidate
        self.candidates.append(candidate)
        self.on_candidate(candidate)
        return candidate

    def grid(
        self, base: ClusteredAttentionConfig, mode: str, clusters: Sequence[int], topks: Sequence[int]
    ) -> None:
        """The (C, k) frontier with every layer patched: C from the largest down to the first failure."""
        topks = topks if self.topk_modes[mode] else (base.topk,)
        upper = len(clusters)  # only C below the cheapest passing one are worth trying at a larger k
        for topk in topks:
            passing = None
            for index in reversed(range(upper)):
                candidate = self.try_(base.replace(mode=mode, clusters=clusters[index], topk=topk), "grid")
                if not candidate.ok:
                    break  # monotone in C: a smaller C would fail too
                passing = index
            if passing is not None:
                upper = passing
            if upper == 0:
                break  # the smallest C passed: a larger k costs more and gains nothing

    def layers(self, mode: str) -> None:
        """Patch fewer layers at the failing grid point nearest to the budget.

        The longest prefix and the longest suffix of layers that stay within budget, each by binary search
        (patching fewer layers never scores worse).
        """
        failed = [c for c in self.candidates if c.config.mode == mode and c.stage == "grid" and not c.ok]
        if not failed or len(self.layer_numbers) < 2:
            return
        failed = [c for c in failed if c.status == "over budget"] or failed  # full-slice changes first
        anchor = max(failed, key=lambda c: (min(c.changes.values()), -c.cost))
        count = len(self.layer_numbers)
        for pick in (lambda m: self.layer_numbers[:m], lambda m: self.layer_numbers[count - m :]):
            low, high = 0, count  # patching 0 layers is the unmodified model; all of them failed
            while high - low > 1:
                middle = (low + high) // 2
                candidate = self.try_(anchor.config.replace(layers=tuple(pick(middle))), "layers")
                low, high = (middle, high) if candidate.ok else (low, middle)


def screen_slack(margin: float, examples: int | None) -> float:
    """How far beyond the budget a screened candidate may be before it is dropped (points).

    At least ``margin``, and at least three examples' worth of the screening chunk (300 / N points: one
    example moves a mean over N examples by at most 100 / N), so that a few flipped predictions on a
    small chunk never drop a candidate.
    """
    return max(margin, 300.0 / examples) if examples else margin


def _check_budget(budget: Any) -> float:
    if (
        isinstance(budget, bool)
        or not isinstance(budget, (int, float))
        or not math.isfinite(budget)
        or budget < 0
    ):
        raise UserError(f"budget must be a number of points >= 0 (e.g. 0.5), got {budget!r}")
    return float(budget)


def tune(
    model: str | Path,
    task: str,
    budget: float = 0.5,
    *,
    clusters: int | str | Sequence[int] | None = None,
    topk: int | str | Sequence[int] | None = None,
    modes: str | Sequence[str] | None = None,
    layers: str | Sequence[int] = "search",
    metric: str | Sequence[str] | None = None,
    seeds: int | Sequence[int] = 1,
    cost: str = "attention",
    screen: int | str | None = "auto",
    screen_margin: float = 2.0,
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None = None,
    data_dir: str | Path | Sequence[str | Path] | None = None,
    limit: int | None = None,
    batch_size: int | None = None,
    max_length: int | None = None,
    device: str = "cpu",
    output: str | Path | None = None,
    save_model: str | Path | None = None,
    overwrite: bool = False,
    reporter: Any = None,
) -> TuneResult:
    """Find the cheapest settings whose score stays within ``budget`` points of the unmodified model.

    Args:
        model: hub id, local folder or ``package:NAME`` (``{task}`` is replaced by the task name).
        task: one task name (``bert-cluster ls``).
        budget: the largest score drop allowed, in points, on every judged metric (0.5: half a point).
        clusters, topk: the grid of C and k (default 10,25,50,100 and 16,32,64); a mode whose output
            does not depend on k (``clustered``) is tried at the attention config's k only.
        modes: the modes to try (default: every mode of ``bert_cluster.config.MODES``).
        layers: ``"search"`` (default): also patch only the first or the last layers of the failing
            grid point nearest the budget; ``"all"``: every layer always; or the layer indices to patch.
        metric: the metric(s) judged against the budget (default: every metric of the task).
        seeds: N (seeds 0..N-1) or the seeds; a candidate's change is the mean over them.
        cost: what "cheapest" means: ``"attention"`` (default), the lowest ``attention_cost`` (per query
            C + k keys against n, averaged over layers; load-independent), or ``"speed"``, the highest
            measured speedup.
        screen: score each candidate first on this many leading examples and drop it when it is more
            than ``budget`` + ``screen_slack`` points down there; ``"auto"``: a quarter of the slice
            when the slice has at least 200 examples; 0 or None: no screening.
        screen_margin: the least screening slack (points); see ``screen_slack``.
        attention: the other settings (bits, iterations, min_length, growth, backend), as in ``evaluate``
            (default min_length 0: every row is approximated, as the evaluator measures).
        data_dir, limit, batch_size, max_length, device: as in ``evaluate``; ``limit`` is the dev slice.
        output: folder for tune.json, tune.md, tune.png and clustered-attention.json (the chosen
            ``ClusteredAttentionConfig.to_dict()``); it must be empty unless ``overwrite``.
        save_model: folder to save the checkpoint converted with the chosen settings to.
        overwrite: replace the files of an earlier run in ``output`` / ``save_model``.
        reporter: progress callbacks (``runner.Reporter``), plus ``candidate(Candidate)`` if it has one.

    Raises:
        UserError: a mistake in the arguments, found before the model is scored.
    """
    began, started = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    budget = _check_budget(budget)
    if not isinstance(task, str) or "," in task or not task.strip():
        raise UserError(f"tune takes one task name (see bert-cluster ls), got {task!r}")
    (task_config,) = get_tasks(task.strip())
    grid_clusters = _numbers("cluster", clusters, DEFAULT_CLUSTERS)
    grid_topk = _numbers("topk", topk, DEFAULT_TOPK)
    chosen_modes = (modes,) if isinstance(modes, str) else tuple(modes or MODES)
    unknown = [mode for mode in chosen_modes if mode not in MODES]
    if unknown or not chosen_modes:
        raise UserError(f"unknown mode(s) {unknown}; allowed: {', '.join(MODES)}")
    chosen_modes = tuple(dict.fromkeys(chosen_modes))
    fixed_layers: tuple[int, ...] | None = None
    if isinstance(layers, str):
        if layers not in ("search", "all"):
            raise UserError(f"layers must be 'search', 'all' or layer indices (e.g. 0,1,2), got {layers!r}")
    else:
        fixed_layers = tuple(layers)
        if not fixed_layers or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in fixed_layers
        ):
            raise UserError(f"layers must be 'search', 'all' or non-negative layer indices, got {layers!r}")
    metric_names = (metric,) if isinstance(metric, str) else tuple(metric or task_config.metric_names)
    unknown = [name for name in metric_names if name not in task_config.metric_names]
    if unknown or not metric_names:
        raise UserError(
            f"task {task_config.name} has no metric {unknown}; "
            f"its metrics: {', '.join(task_config.metric_names)}"
        )
    seed_list = runner.parse_seeds(seeds)
    if cost not in COSTS:
        raise UserError(f"cost must be one of {', '.join(COSTS)}, got {cost!r}")
    if isinstance(screen_margin, bool) or not isinstance(screen_margin, (int, float)) or screen_margin < 0:
        raise UserError(f"screen_margin must be a number of points >= 0, got {screen_margin!r}")
    if screen not in (None, 0, "auto"):
        positive_int("screen", screen)
    for name, value in (("limit", limit), ("batch_size", batch_size), ("max_length", max_length)):
        if value is not None:
            positive_int(name, value)
    named = set(attention) if isinstance(attention, Mapping) else set()
    searched = sorted({"clusters", "topk", "mode", "seed"} & named)
    if searched:
        raise UserError(
            f"attention= sets {', '.join(searched)}, which tune searches (it would replace them): give "
            "them as tune's clusters=, topk=, modes= and seeds="
        )
    base = attention_config(attention, {}, presets.EVALUATION_SETTINGS)
    if fixed_layers is not None:
        base = base.replace(layers=fixed_layers)
    try:
        for mode in chosen_modes:  # every setting validated now, not mid-search
            base.replace(mode=mode, clusters=grid_clusters[0], topk=grid_topk[0])
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None
    device = check_device(device)
    runner.attention_backend(base, device)
    model_path = check_model_path(resolve_model(str(model)).replace("{task}", task_config.name))
    if output is not None:
        reports.check_output(output, overwrite)
    if save_model is not None:
        reports.check_output(save_model, overwrite)
    folders = tuple(data_dirs(data_dir)) if data_dir is not None else ()

    workers = Workers(device)
    reporter = reporter if reporter is not None and workers.is_main else runner.SilentReporter()
    options = {"data_dirs": folders, "batch_size": batch_size, "max_length": max_length, "device": device}
    notes: list[str] = []
    interrupted = False
    reporter.start(1)
    try:
        session = runner.TaskSession(
            task_config, model_path, limit=limit, workers=workers, reporter=reporter, **options
        )
        count = session.examples.count
        if screen == "auto":
            screen_count = count // 4 if count >= AUTO_SCREEN_MIN else None
        else:
            screen_count = screen or None
        if screen_count is not None and screen_count >= count:
            screen_count = None  # screening on the whole slice would only score it twice
        numbers = _layer_numbers(session.loaded.target)
        # at most: every grid point and a binary search of prefix and suffix per mode, each screened
        per_mode = len(grid_clusters) * len(grid_topk) + 2 * math.ceil(math.log2(max(len(numbers or ()), 2)))
        passes = len(seed_list) + (screen_count is not None)
        reporter.task(
            f"{task_config.name} (tuning, at most)",
            1 + (screen_count is not None) + per_mode * len(chosen_modes) * passes,
        )
        unmodified = session.score(None)
        timing = session.workers.combined_timing()
        length = timing.tokens / timing.items if timing.items and timing.tokens else float("nan")
        screen_session = None
        if screen_count is not None:
            screen_session = runner.TaskSession(
                task_config, model_path, limit=screen_count, workers=workers, reporter=reporter, **options
            )
            screen_session.score(None)
        if numbers is None:
            numbers = list(fixed_layers or ())
            if layers == "search":
                notes.append("the model's layers share attention modules: no layer search")
        topk_modes = {mode: uses_topk(mode) for mode in chosen_modes}
        search = _Search(
            session,
            screen_session,
            metric_names,
            budget,
            screen_slack(float(screen_margin), screen_count),
            seed_list,
            length if math.isfinite(length) else 512.0,
            numbers,
            topk_modes,
            getattr(reporter, "candidate", lambda candidate: None),
        )
        try:
            for mode in chosen_modes:
                search.grid(base, mode, grid_clusters, grid_topk)
                if layers == "search" and numbers:
                    search.layers(mode)
        except KeyboardInterrupt:
            interrupted = True
            notes.append(f"interrupted (Ctrl-C) after {len(search.candidates)} candidate(s)")
    finally:
        reporter.finish()
    chosen = _cheapest([c for c in search.candidates if c.ok], cost)
    if chosen is not None and chosen.cost >= 1.0:
        notes.append("the chosen settings save no attention work at this length (C + k >= n)")
    if chosen is not None and chosen.speedup is not None and chosen.speedup < 1.0:
        notes.append("the chosen settings measured slower than the unmodified model here")
    settings = {
        "clusters": list(grid_clusters),
        "topk": list(grid_topk),
        "modes": list(chosen_modes),
        "layers": layers if isinstance(layers, str) else list(layers),
        "seeds": list(seed_list),
        "screen": screen,
        "screen_margin": screen_margin,
        "attention": {
            k: v for k, v in base.to_dict().items() if k not in ("clusters", "topk", "mode", "seed")
        },
        "data_dirs": [str(folder) for folder in folders],
        "limit": limit,
        "batch_size": batch_size,
        "max_length": max_length,
        "device": device,
    }
    result = TuneResult(
        task=task_config.name,
        model=str(model_path),
        budget=budget,
        metrics=[(m.name, m.display) for m in task_config.metrics if m.name in metric_names],
        cost=cost,
        unmodified=unmodified,
        candidates=search.candidates,
        chosen=chosen,
        examples=count,
        screen_examples=screen_count,
        mean_length=length if math.isfinite(length) else None,
        settings=settings,
        environment=reports.environment(session.settings.device, workers.count),
        started=started,
        notes=notes,
    )
    result.wall_time_s = time.perf_counter() - began
    if interrupted:
        written = write(result, output)["tune.json"] if output is not None and workers.is_main else None
        raise TuneInterrupted(result, written)
    if workers.is_main:
        if output is not None:
            write(result, output)
        if save_model is not None and result.config is not None:
            convert_checkpoint(model_path, save_model, result.config, overwrite=overwrite)
    return result


def _cheapest(passing: Sequence[Candidate], cost: str) -> Candidate | None:
    """The cheapest candidate within budget: lowest modeled cost (ties: smaller drop), or highest speedup."""
    if not passing:
        return None

    def speed(candidate: Candidate) -> float:
        return candidate.speedup if candidate.speedup is not None else 0.0

    if cost == "speed":
        return max(passing, key=lambda c: (speed(c), -c.cost))
    return min(passing, key=lambda c: (c.cost, -min(c.changes.values()), -speed(c)))


# --- what is written ------------------------------------------------------------------------------------


def table_rows(result: TuneResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the trade-off table (shared by tune.md and the CLI): one row per candidate."""
    displays = [display for _, display in result.metrics]
    header = [
        "#",
        "candidate",
        "stage",
        *[f"Δ {display}" for display in displays],
        "speedup",
        "cost",
        "verdict",
    ]
    rows = [
        [
            "",
            "unmodified: "
            + ", ".join(
                f"{display} {result.unmodified.scores[name]:.2f}" for name, display in result.metrics
            ),
            "-",
            *["0.00" for _ in result.metrics],
            "1.00×",
            "1.00",
            "reference",
        ]
    ]
    for number, candidate in enumerate(result.candidates, 1):
        verdict = candidate.status + (" ← chosen" if candidate is result.chosen else "")
        changes = [f"{candidate.changes[name]:+.2f}" for name, _ in result.metrics]
        if candidate.screen is not None and candidate.status == "screened out":
            changes = [f"{change} (first {result.screen_examples})" for change in changes]
        speed = "-" if candidate.speedup is None else f"{candidate.speedup:.2f}×"
        rows.append(
            [str(number), candidate.label, candidate.stage, *changes, speed, f"{candidate.cost:.2f}", verdict]
        )
    return header, rows


def markdown(result: TuneResult) -> str:
    """tune.md: the recommendation, the trade-off table, the settings and the environment."""
    header, rows = table_rows(result)
    judged = ", ".join(display for _, display in result.metrics)
    lines = [
        f"# bert-cluster tune: {result.task}",
        "",
        f"Model `{result.model}`, {result.examples} examples"
        + (f" (screening on the first {result.screen_examples})" if result.screen_examples else "")
        + f"; budget {result.budget:g} point(s) on {judged}; cheapest by "
        + ("measured speedup" if result.cost == "speed" else "the attention cost model")
        + ".",
        "",
        f"**Recommendation:** {result.recommendation}.",
        "",
        "Δ: score change from the unmodified model in points (mean over the seeds); speedup: the unmodified "
        "model's wall time over the candidate's, same batches after a warm-up batch; cost: attention work "
        "relative to exact attention, per query (C + k) / n over the layers (n = "
        + ("?" if result.mean_length is None else f"{result.mean_length:.0f}")
        + " tokens, the slice's mean row length).",
        "",
        *markdown_table(header, rows, 3),
        "",
    ]
    if result.notes:
        lines += ["Notes: " + "; ".join(result.notes) + ".", ""]
    return "\n".join([*lines, *metadata_markdown(result.settings, result.environment)])


def plot(result: TuneResult, path: Path) -> Path | None:
    """tune.png: score change against measured speedup (left) and against modeled cost (right).

    One point per candidate scored in full (filled: every layer patched; hollow: some layers), one
    colour and marker per mode, the chosen one ringed in red; the dashed line is the budget. One row
    per judged metric. None when no candidate was scored in full.
    """
    scored = [c for c in result.candidates if c.speedup is not None]
    if not scored:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = len(result.metrics)
    figure, panels = plt.subplots(rows, 2, figsize=(13, 5 * rows), squeeze=False)
    modes = sorted({c.config.mode for c in scored})
    markers = {mode: "osD^vP*X"[index % 8] for index, mode in enumerate(modes)}
    colors = {mode: f"C{index % 10}" for index, mode in enumerate(modes)}
    axis_kinds = (
        (lambda c: c.speedup, "measured speedup over unmodified (×)", 1.0),
        (lambda c: c.cost, "modeled attention cost (exact = 1)", 1.0),
    )
    for row, (name, display) in zip(panels, result.metrics, strict=True):
        for axes, (x_of, xlabel, reference) in zip(row, axis_kinds, strict=True):
            for mode in modes:
                for stage, filled in (("grid", True), ("layers", False)):
                    points = [c for c in scored if c.config.mode == mode and c.stage == stage]
                    if not points:
                        continue
                    axes.scatter(
                        [x_of(c) for c in points],
                        [c.changes[name] for c in points],
                        marker=markers[mode],
                        facecolors=colors[mode] if filled else "none",
                        edgecolors=colors[mode],
                        label=mode + ("" if filled else " (some layers)"),
                    )
                    for c in points:
                        text = (
                            f"C={c.config.clusters}"
                            + (f" k={c.config.topk}" if c.uses_topk else "")
                            + ("" if c.config.layers is None else f" L{c.layers_label}")
                        )
                        axes.annotate(text, (x_of(c), c.changes[name]), xytext=(3, 3),
                                      textcoords="offset points", fontsize="x-small")  # fmt: skip
            if result.chosen is not None and result.chosen.speedup is not None:
                axes.scatter([x_of(result.chosen)], [result.chosen.changes[name]], s=260, facecolors="none",
                             edgecolors="red", linewidths=2, label="chosen")  # fmt: skip
            axes.axhline(-result.budget, color="red", linestyle="--", linewidth=1,
                         label=f"budget (-{result.budget:g})")  # fmt: skip
            axes.axhline(0.0, color="grey", linewidth=1)
            axes.axvline(reference, color="grey", linewidth=1, linestyle=":")
            low, high = axes.get_ylim()
            axes.set(ylim=(min(low, -result.budget - 0.5), max(high, 0.5)))
            axes.set(title=f"{result.task}: {display}", xlabel=xlabel, ylabel="score change (points)")
            axes.grid(alpha=0.3)
            axes.legend(fontsize="small", loc="best")
    cheapest = "modeled attention cost" if result.cost == "attention" else "measured speedup"
    figure.suptitle(f"bert-cluster tune: budget {result.budget:g} point(s), cheapest by {cheapest}")
    figure.tight_layout()
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=120, format="png"))
    plt.close(figure)
    return path


def write(result: TuneResult, folder: str | Path) -> dict[str, Path]:
    """Write tune.json, tune.md, tune.png and (when one is chosen) clustered-attention.json into ``folder``.

    Through ``reports.write_report``: a stale chosen config of an earlier run never sits beside new results.
    """
    chosen = {} if result.config is None else {"clustered-attention.json": result.config.to_dict()}
    return write_report(
        folder,
        TUNE_FILES,
        result.to_dict(),
        markdown(result),
        plot=lambda path: plot(result, path),
        extra={name: json.dumps(config, indent=2) + "\n" for name, config in chosen.items()},
    )


def load_config(path: str | Path) -> ClusteredAttentionConfig:
    """The settings a tuning run saved (clustered-attention.json, or a tune.json's chosen config)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {one_line(error)}") from None
    if isinstance(data, dict) and "chosen_config" in data:
        data = data["chosen_config"]
        if data is None:
            raise UserError(f"{path}: the tuning run chose no settings (none stayed within its budget)")
    return ClusteredAttentionConfig.from_dict(data)
