"""Typed results of an evaluation run, and what is written from them: results.json, results.md, a plot.

``Results.to_dict()`` is the results.json schema (``schema_version`` bumps when it changes): the run's
settings, the environment (package versions, hardware, git hash, date), and per task its version,
status (``ok`` / ``failed`` with the error), the data file it read, and every run (the unmodified
model, then one per cluster count and seed) with scores, wall time and examples per second.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
_PACKAGES = (
    "bert-cluster",
    "torch",
    "transformers",
    "tokenizers",
    "datasets",
    "numpy",
    "scipy",
    "scikit-learn",
    "pandas",
    "pyarrow",
)


@dataclasses.dataclass
class RunResult:
    """One configuration scored on one task: the unmodified model (``clusters`` None) or C + seed."""

    clusters: int | None
    seed: int | None
    scores: dict[str, float]
    wall_time_s: float
    examples_per_s: float
    attention: dict[str, Any] | None = None  # ClusteredAttentionConfig.to_dict(); None: unmodified

    @property
    def label(self) -> str:
        """``unmodified`` or ``C=25 seed=0``."""
        return "unmodified" if self.clusters is None else f"C={self.clusters} seed={self.seed}"


@dataclasses.dataclass
class TaskResult:
    """Everything measured on one task, or why it failed."""

    task: str
    kind: str
    version: int | None
    status: str = "ok"  # "ok" or "failed"
    error: str | None = None
    model: str | None = None
    source: str | None = None
    examples: int = 0
    metrics: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, display)
    runs: list[RunResult] = dataclasses.field(default_factory=list)
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
    def cluster_counts(self) -> list[int]:
        """The cluster counts scored, ascending."""
        return sorted({run.clusters for run in self.runs if run.clusters is not None})

    def patched(self, metric: str, clusters: int) -> list[float]:
        """One score per seed at ``clusters``."""
        return [run.scores[metric] for run in self.runs if run.clusters == clusters and metric in run.scores]

    def summary(self, metric: str, clusters: int) -> dict[str, float | int | None]:
        """Mean, spread (sample standard deviation, None for one seed) and delta to unmodified."""
        values = self.patched(metric, clusters)
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
        """The tasks that failed."""
        return [task for task in self.tasks if not task.ok]

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
                name: {str(c): task.summary(name, c) for c in task.cluster_counts} for name, _ in task.metrics
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


def _git_hash() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str = "cpu") -> dict[str, Any]:
    """Package versions, hardware, git hash and date: what makes a results.json interpretable later."""
    import torch

    versions = {"python": platform.python_version()}
    for package in _PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    hardware: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        hardware["gpu"] = torch.cuda.get_device_name(torch.device(device))
    kernels: Any = None
    try:
        from bert_cluster._loader import build_info

        kernels = build_info()
    except Exception as error:  # noqa: BLE001 - informational only; never fail a run over it
        kernels = f"unavailable: {type(error).__name__}: {error}"
    return {
        "packages": versions,
        "hardware": hardware,
        "kernels": kernels,
        "git": _git_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


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
    """Header and rows of the summary table shared by results.md and the CLI."""
    clusters = sorted({c for task in results.tasks for c in task.cluster_counts})
    header = ["task", "metric", "unmodified", *[f"C={c}" for c in clusters]]
    rows = []
    for task in results.tasks:
        if not task.ok and not task.runs:
            rows.append([task.task, "failed", task.error or "", *[""] * len(clusters)])
            continue
        for name, display in task.metrics:
            base = task.unmodified.scores.get(name) if task.unmodified else None
            cells = [
                format_cell(task.summary(name, c)) if c in task.cluster_counts else "-" for c in clusters
            ]
            rows.append([task.task, display, "-" if base is None else f"{base:.2f}", *cells])
        if not task.ok:
            rows.append([task.task, "failed", task.error or "", *[""] * len(clusters)])
    return header, rows


def markdown(results: Results) -> str:
    """results.md: the table, the settings, where each task's data came from, the environment."""
    header, rows = table_rows(results)
    seeds = results.settings.get("seeds") or []
    lines = [
        "# bert-cluster evaluation",
        "",
        f"Scores in points; patched cells are mean ± sample std over {len(seeds)} seed(s) {seeds}, "
        "with the difference to the unmodified model in brackets.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|",
    ]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    lines += [
        "",
        "## Runs",
        "",
        "| task | configuration | wall time (s) | examples/s |",
        "|---|---|---:|---:|",
    ]
    for task in results.tasks:
        for run in task.runs:
            lines.append(f"| {task.task} | {run.label} | {run.wall_time_s:.1f} | {run.examples_per_s:.1f} |")
    lines += ["", "## Data and models", ""]
    for task in results.tasks:
        status = "ok" if task.ok else f"failed: {task.error}"
        lines.append(
            f"- **{task.task}** (v{task.version}, {task.examples} examples, {status}): "
            f"model `{task.model}`, data `{task.source}`"
        )
    env = results.environment
    lines += [
        "",
        "## Settings and environment",
        "",
        "```json",
        json.dumps(
            {
                "settings": results.settings,
                "packages": env.get("packages"),
                "hardware": env.get("hardware"),
                "git": env.get("git"),
                "date": env.get("date"),
            },
            indent=2,
        ),
        "```",
        "",
    ]
    return "\n".join(lines)


def plot(results: Results, path: Path) -> Path | None:
    """Score against cluster count, one line per task and metric (dotted: unmodified); None: no C scored."""
    series = [
        (task, name, display)
        for task in results.tasks
        if task.cluster_counts
        for name, display in task.metrics
    ]
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, (task, name, display) in enumerate(series):
        color = colors[number % len(colors)]
        counts = [c for c in task.cluster_counts if task.summary(name, c)["mean"] is not None]
        summaries = [task.summary(name, c) for c in counts]
        means = [s["mean"] for s in summaries]
        spreads = [s["std"] or 0.0 for s in summaries]
        axes.errorbar(
            counts, means, yerr=spreads, marker="o", capsize=3, color=color, label=f"{task.task} {display}"
        )
        base = task.unmodified.scores.get(name) if task.unmodified else None
        if base is not None and not math.isnan(base):
            axes.axhline(base, color=color, linestyle=":", linewidth=1)
    mode = results.settings.get("mode", "")
    axes.set_xscale("log")
    counts = sorted({c for task, _, _ in series for c in task.cluster_counts})
    axes.set_xticks(counts, [str(c) for c in counts])
    axes.set_xlabel("clusters C")
    axes.set_ylabel("score (points)")
    axes.set_title(f"{mode} attention vs cluster count (dotted: unmodified)")
    axes.legend(fontsize="small", loc="best")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write(results: Results, folder: str | Path) -> dict[str, Path]:
    """Write results.json, results.md and (when a cluster count was scored) scores.png into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {"json": folder / "results.json", "markdown": folder / "results.md"}
    written["json"].write_text(json.dumps(results.to_dict(), indent=2) + "\n", encoding="utf-8")
    written["markdown"].write_text(markdown(results), encoding="utf-8")
    png = plot(results, folder / "scores.png")
    if png is not None:
        written["plot"] = png
    return written
