"""Evaluate's typed results and its report: results.json, results.md and scores.png.

Written through the one report writer, ``bert_cluster.reports.write_report`` (atomic files, the run's
settings and environment in each).

``Results.to_dict()`` is the results.json schema (``schema_version`` bumps when it changes): the run's
settings, the environment (package versions, hardware, git hash, date), and per task its version,
status (``ok``, ``failed`` with the error, or ``interrupted``), the data it read, and every run (the
unmodified model, then one per mode, cluster count and seed) with its scores beside its speed: wall time
of the model passes, examples/s, tokens/s, speedup over the unmodified model and the attention backend.

"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bert_cluster.reports import (
    ReportFiles,
    atomic_write,
    markdown_table,
    metadata_markdown,
    write_report,
)

SCHEMA_VERSION = 2


#: What ``evaluate`` writes.
RESULTS_FILES = ReportFiles("results.json", "results.md", "scores.png")
#: The files a run writes (and the only ones ``--overwrite`` may remove).
FILES = RESULTS_FILES.names


@dataclasses.dataclass
class RunResult:
    """One configuration scored on one task: the unmodified model (``clusters`` None) or mode + C + seed.

    ``wall_time_s`` is the time of the model passes over the task's batches after a warm-up batch (the
    slowest process's, in a data-parallel run); ``speedup`` is the unmodified run's wall time over this
    one's, on the same batches; ``backend`` is the attention that ran (``sdpa`` or whatever the model
    used unmodified; ``cpu``, ``cuda`` or ``reference`` patched).
    """

    clusters: int | None
    seed: int | None
    scores: dict[str, float]
    wall_time_s: float
    examples_per_s: float
    tokens_per_s: float | None = None
    speedup: float | None = None
    backend: str | None = None
    mode: str | None = None
    processes: int = 1
    attention: dict[str, Any] | None = None  # ClusteredAttentionConfig.to_dict(); None: unmodified

    @property
    def key(self) -> tuple[str, int] | None:
        """``(mode, clusters)``: what seeds are averaged over; None for the unmodified run."""
        return None if self.clusters is None else (self.mode or "", self.clusters)

    @property
    def label(self) -> str:
        """``unmodified`` or ``i-clustered C=25 seed=0``."""
        return "unmodified" if self.clusters is None else f"{self.mode} C={self.clusters} seed={self.seed}"


def column(key: tuple[str, int], modes: int) -> str:
    """A table column for ``(mode, C)``: ``C=25``, or ``clustered C=25`` when several modes ran."""
    return f"C={key[1]}" if modes < 2 else f"{key[0]} C={key[1]}"


@dataclasses.dataclass
class TaskResult:
    """Everything measured on one task, or why it failed."""

    task: str
    kind: str
    version: int | None
    status: str = "ok"  # "ok", "failed" or "interrupted"
    error: str | None = None
    model: str | None = None
    source: str | None = None
    examples: int = 0
    metrics: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, display)
    runs: list[RunResult] = dataclasses.field(default_factory=list)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. corpus size, encoder modules
    config: dict[str, Any] | None = None  # the TaskConfig as loaded

    @property
    def ok(self) -> bool:
        """True when every configuration was scored."""
        return self.status == "ok"

    @property
    def unmodified(self) -> RunResult | None:
        """The run of the unmodified model, if it finished."""
        return next((run for run in self.runs if run.clusters is None), None)

    @property
    def keys(self) -> list[tuple[str, int]]:
        """The (mode, C) pairs scored, in mode then C order."""
        return sorted({run.key for run in self.runs if run.key is not None})

    def summary(self, metric: str, key: tuple[str, int]) -> dict[str, float | int | None]:
        """Mean, spread (sample standard deviation, None for one seed) and delta to unmodified."""
        values = [run.scores[metric] for run in self.runs if run.key == key and metric in run.scores]
        if not values:
            return {"mean": None, "std": None, "delta": None, "seeds": 0}
        mean = statistics.fmean(values)
        base = self.unmodified.scores.get(metric) if self.unmodified else None
        return {
            "mean": mean,
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "delta": None if base is None else mean - base,
            "seeds": len(values),
        }

    def speed(self, key: tuple[str, int]) -> dict[str, float | None]:
        """Mean wall time and speedup over the seeds of ``key``."""
        runs = [run for run in self.runs if run.key == key]
        speedups = [run.speedup for run in runs if run.speedup is not None]
        return {
            "wall_time_s": statistics.fmean(run.wall_time_s for run in runs) if runs else None,
            "speedup": statistics.fmean(speedups) if speedups else None,
        }


@dataclasses.dataclass
class Results:
    """An evaluation run: what the API returns, the CLI prints and results.json stores."""

    tasks: list[TaskResult]
    settings: dict[str, Any]
    environment: dict[str, Any]
    started: str
    wall_time_s: float = 0.0
    complete: bool = True  # False in the partial results.json written while a run goes on
    schema_version: int = SCHEMA_VERSION

    @property
    def ok(self) -> bool:
        """True when no task failed."""
        return all(task.ok for task in self.tasks)

    @property
    def failed(self) -> list[TaskResult]:
        """The tasks that failed (or were interrupted)."""
        return [task for task in self.tasks if not task.ok]

    @property
    def modes(self) -> int:
        """How many attention modes were scored."""
        return len({key[0] for task in self.tasks for key in task.keys})

    def __getitem__(self, task: str) -> TaskResult:
        for result in self.tasks:
            if result.task == task:
                return result
        raise KeyError(f"no task {task!r} in these results; have {[t.task for t in self.tasks]}")

    def to_dict(self) -> dict[str, Any]:
        """The results.json document."""
        tasks = []
        for task in self.tasks:
            entry = dataclasses.asdict(task)
            entry["metrics"] = [{"name": name, "display": display} for name, display in task.metrics]
            entry["summary"] = {
                column(key, 2): {
                    **{name: task.summary(name, key) for name, _ in task.metrics},
                    "speed": task.speed(key),
                }
                for key in task.keys
            }
            tasks.append(entry)
        return {
            "schema_version": self.schema_version,
            "started": self.started,
            "wall_time_s": self.wall_time_s,
            "complete": self.complete,
            "settings": self.settings,
            "environment": self.environment,
            "tasks": tasks,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Results:
        """Read a results.json document back."""
        tasks = []
        for entry in data["tasks"]:
            entry = dict(entry)
            entry.pop("summary", None)
            entry["metrics"] = [(m["name"], m["display"]) for m in entry.get("metrics", [])]
            entry["runs"] = [RunResult(**run) for run in entry.get("runs", [])]
            tasks.append(TaskResult(**entry))
        return cls(
            tasks=tasks,
            settings=dict(data["settings"]),
            environment=dict(data["environment"]),
            started=data["started"],
            wall_time_s=data.get("wall_time_s", 0.0),
            complete=data.get("complete", True),
            schema_version=data.get("schema_version", SCHEMA_VERSION),
        )


def format_cell(summary: Mapping[str, Any]) -> str:
    """``mean ± std (delta)`` in points, as the tables show a patched configuration."""
    if summary["mean"] is None:
        return "-"
    text = f"{summary['mean']:.2f}"
    if summary["std"] is not None:
        text += f" ± {summary['std']:.2f}"
    if summary["delta"] is not None:
        text += f" ({summary['delta']:+.2f})"
    return text


def table_rows(results: Results) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the summary table shared by results.md and the CLI: scores, then speed."""
    keys = sorted({key for task in results.tasks for key in task.keys})
    header = ["task", "metric", "unmodified", *[column(key, results.modes) for key in keys]]
    rows = []
    for task in results.tasks:
        base = task.unmodified
        for name, display in task.metrics if task.runs else []:
            value = base.scores.get(name) if base else None
            cells = [format_cell(task.summary(name, key)) if key in task.keys else "-" for key in keys]
            rows.append([task.task, display, "-" if value is None else f"{value:.2f}", *cells])
        if base is not None:
            cells = []
            for key in keys:
                speed = task.speed(key)
                ok = speed["speedup"] is not None and speed["wall_time_s"] is not None
                cells.append(f"{speed['speedup']:.2f}× ({speed['wall_time_s']:.1f} s)" if ok else "-")
            rows.append([task.task, "speed", f"1.00× ({base.wall_time_s:.1f} s)", *cells])
        if not task.ok:
            rows.append([task.task, task.status, task.error or "", *[""] * len(keys)])
    return header, rows


def markdown(results: Results) -> str:
    """results.md: the table, speed per run, settings, where each task's data came from, environment."""
    header, rows = table_rows(results)
    seeds = results.settings.get("seeds") or []
    min_length = (results.settings.get("attention") or {}).get("min_length")
    lines = [
        "# bert-cluster evaluation",
        "",
        f"Scores in points; patched cells are mean ± sample std over {len(seeds)} seed(s) {seeds}, "
        "with the difference to the unmodified model in brackets. Speed: the unmodified model's wall time "
        "over the patched model's, on the same batches after a warm-up batch.",
        "",
        f"Attention min_length = {min_length}: "
        + (
            "every row longer than C tokens is approximated (the evaluator measures the approximation; "
            "rows of at most C tokens are exact by construction)."
            if min_length == 0
            else "rows shorter than that use exact attention, so they are not approximated."
        ),
        "",
        *markdown_table(header, rows, 2),
        "",
        "## Speed",
        "",
    ]
    speed_rows = [
        [
            task.task,
            run.label,
            run.backend or "-",
            f"{run.wall_time_s:.2f}",
            f"{run.examples_per_s:.1f}",
            "-" if run.tokens_per_s is None else f"{run.tokens_per_s:,.0f}",
            "-" if run.speedup is None else f"{run.speedup:.2f}×",
        ]
        for task in results.tasks
        for run in task.runs
    ]
    lines += markdown_table(
        ["task", "configuration", "attention", "wall time (s)", "examples/s", "tokens/s", "speedup"],
        speed_rows,
        3,
    )
    lines += ["", "## Data and models", ""]
    for task in results.tasks:
        status = "ok" if task.ok else f"{task.status}: {task.error}"
        notes = "".join(f", {key} {value}" for key, value in task.notes.items())
        lines.append(
            f"- **{task.task}** (v{task.version}, {task.examples} examples{notes}, {status}): "
            f"model `{task.model}`, data `{task.source}`"
        )
    return "\n".join([*lines, "", *metadata_markdown(results.settings, results.environment)])


def plot(results: Results, path: Path) -> Path | None:
    """scores.png, one column per task: score against C (top) and score change against speedup (bottom).

    The bottom panel is the trade-off a user chooses from: each point is a mode and a cluster count.
    Dotted lines: the unmodified model. None when no patched configuration was scored.
    """
    tasks = [task for task in results.tasks if task.keys and task.unmodified is not None]
    if not tasks:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(2, len(tasks), figsize=(max(7, 4.5 * len(tasks)), 8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    modes = sorted({key[0] for task in tasks for key in task.keys})
    for (top, bottom), task in zip(panels.T, tasks, strict=True):
        for number, (name, display) in enumerate(task.metrics):
            color = colors[number % len(colors)]
            for mode in modes:
                keys = [
                    key for key in task.keys if key[0] == mode and task.summary(name, key)["mean"] is not None
                ]
                if not keys:
                    continue
                label = display + (f" ({mode})" if len(modes) > 1 else "")
                style = {"marker": "osD^vP*X"[modes.index(mode) % 8], "color": color, "label": label}
                summaries = [task.summary(name, key) for key in keys]
                top.errorbar([key[1] for key in keys], [s["mean"] for s in summaries], capsize=3, **style,
                             yerr=[s["std"] or 0.0 for s in summaries])  # fmt: skip
                speedups = [task.speed(key)["speedup"] for key in keys]
                points = [
                    (x, s["delta"], key[1]) for x, s, key in zip(speedups, summaries, keys, strict=True)
                ]
                points = [point for point in points if point[0] is not None]
                bottom.plot([p[0] for p in points], [p[1] for p in points], **style)
                for x, delta, clusters in points:
                    bottom.annotate(f"C={clusters}", (x, delta), xytext=(3, 3), textcoords="offset points",
                                    fontsize="x-small")  # fmt: skip
            base = task.unmodified.scores.get(name)
            if base is not None and not math.isnan(base):
                top.axhline(base, color=color, linestyle=":", linewidth=1)
        counts = sorted({key[1] for key in task.keys})
        top.set_xscale("log")
        top.minorticks_off()
        top.set_xticks(counts, [str(c) for c in counts])
        top.set(title=task.task, xlabel="clusters C", ylabel="score (points)")
        bottom.axhline(0.0, color="grey", linewidth=1)
        bottom.axvline(1.0, color="grey", linewidth=1, linestyle=":")
        low, high = bottom.get_ylim()  # at least +-0.5 points: a change of 1e-6 must not look like a cliff
        bottom.set(ylim=(min(low, -0.5), max(high, 0.5)), xlabel="speedup over unmodified (x)")
        bottom.set_ylabel("score change (points)")
        for axes in (top, bottom):
            axes.legend(fontsize="small", loc="best")
            axes.grid(alpha=0.3)
    figure.suptitle(f"{', '.join(modes)} attention against the unmodified model (dotted)")
    figure.tight_layout()
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=120, format="png"))
    plt.close(figure)
    return path


def write(results: Results, folder: str | Path) -> dict[str, Path]:
    """Write results.json, results.md and scores.png into ``folder`` (checked by ``check_output``)."""
    return write_report(
        folder,
        RESULTS_FILES,
        results.to_dict(),
        markdown(results),
        plot=lambda path: plot(results, path),
    )
