"""finetune.json, finetune.md and loss.png: the settings, the loss curve and the environment of a run.

Written through the one report writer (``bert_cluster.reports.write_report``), beside the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bert_cluster.reports import ReportFiles, environment, markdown_table, metadata_markdown, write_report

#: What ``finetune`` writes beside the checkpoint.
FILES = ReportFiles("finetune.json", "finetune.md", "loss.png")
SCHEMA_VERSION = 1


def document(result: Any) -> dict[str, Any]:
    """The JSON document: the result with its schema version and the environment it ran in."""
    return {
        "schema_version": SCHEMA_VERSION,
        **result.to_dict(),
        "environment": environment(result.settings["device"]),
    }


def markdown(result: Any, environment_: dict[str, Any]) -> str:
    """A summary and the loss curve (at most 20 rows, evenly spaced, the last included)."""
    settings = result.settings
    attention = settings["attention"]
    how = (
        "exact attention (control)"
        if attention is None
        else f"{attention['mode']}, C = {attention['clusters']}, k = {attention['topk']}"
    )
    curve = result.loss_curve
    shown = curve if len(curve) <= 20 else [curve[round(i * (len(curve) - 1) / 19)] for i in range(20)]
    rows = [[str(entry["step"]), f"{entry.get('epoch', 0):.2f}", f"{entry['loss']:.4f}"] for entry in shown]
    lines = [
        f"# Fine-tuning: {settings['task']}",
        "",
        f"Model `{settings['model']}` trained with {how}, "
        f"{'LoRA' if settings['lora'] else 'every weight'}, {result.steps} steps on {result.examples} rows "
        f"({result.features} features) of `{result.source}`"
        + (f", resumed from {result.resumed_from}" if result.resumed_from else "")
        + f"; {result.train_seconds:.1f} s of training"
        + (" (all parts)" if result.resumed_from else "")
        + f". The checkpoint: `{result.output}`.",
        "",
        *markdown_table(["step", "epoch", "loss"], rows, 0),
        "",
        *evaluations_markdown(result.evaluations),
    ]
    return "\n".join([*lines, *metadata_markdown(settings, environment_)])


def evaluations_markdown(evaluations: list[dict[str, Any]]) -> list[str]:
    """The held-out scores at each mark of training time (nothing without marks)."""
    if not evaluations:
        return []
    metrics = list(evaluations[0]["scores"])
    exact = "exact_attention" in evaluations[0]
    rows = [
        [f"{entry['mark']:g}", f"{entry['seconds']:.1f}", str(entry["step"])]
        + [f"{entry['scores'].get(name, float('nan')):.4f}" for name in metrics]
        + [f"{entry.get('exact_attention', {}).get(name, float('nan')):.4f}" for name in metrics if exact]
        for entry in evaluations
    ]
    scored_exact = [f"{name}, scored exact" for name in metrics if exact]
    return [
        "Held-out scores at marks of training time (scoring excluded from the clock):",
        "",
        *markdown_table(["mark (s)", "training time (s)", "step", *metrics, *scored_exact], rows, 0),
        "",
    ]


def plot(
    curve: list[dict[str, float]], path: Path, evaluations: list[dict[str, Any]] | None = None
) -> Path | None:
    """loss.png: the training loss against the step, and the held-out scores against training time.

    None: no step was logged.
    """
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, 2 if evaluations else 1, figsize=(12 if evaluations else 7, 4), squeeze=False
    )
    axis = axes[0][0]
    axis.plot([entry["step"] for entry in curve], [entry["loss"] for entry in curve])
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    if evaluations:
        held_out = axes[0][1]
        for name in evaluations[0]["scores"]:
            held_out.plot(
                [entry["seconds"] for entry in evaluations],
                [entry["scores"].get(name, float("nan")) for entry in evaluations],
                marker="o",
                label=name,
            )
        held_out.set_xlabel("training time (s)")
        held_out.set_ylabel("held-out score")
        held_out.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write(result: Any, folder: Path) -> dict[str, Path]:
    """Write the three files into ``folder`` (atomically; earlier finetune files replaced)."""
    data = document(result)
    return write_report(
        folder,
        FILES,
        data,
        markdown(result, data["environment"]),
        plot=lambda path: plot(result.loss_curve, path, result.evaluations),
    )
