"""Where clustered attention departs from exact attention, layer by layer and head by head.

``inspect_model`` runs a model once with exact attention, captures each self-attention layer's queries,
keys and values, and compares on them, per head, exact attention with clustered attention as
``convert`` would run it (same settings, same per-layer hash planes, same routing of short rows):

* ``relative_error``: ``||O_clustered - O_exact||_F / ||O_exact||_F`` over the valid query positions of
  all inspected sequences: the error this layer adds on its own (its inputs are exact);
* ``topk_mass``: the mean, over clustered queries, of the exact attention weight that falls on the keys
  their cluster recomputes exactly (its top-k): how much of each query's attention the refinement
  covers (1.0 when k >= N; None for plain ``clustered``, which recomputes no key);
* cluster sizes: non-empty clusters per sequence, mean members per cluster and the largest cluster's
  share of the tokens (a few huge clusters mean the partition is coarse there).

A layer whose error stays small can be patched; ``Inspection.suggest_layers`` names the layers to pass as
``layers=`` for a given error budget. The same numbers back ``bert-cluster inspect`` (table, JSON and a
heatmap PNG); ``write`` saves inspect.json / inspect.md / inspect.png through the one report writer
(``bert_cluster.reports.write_report``). Importing this module imports neither transformers nor
the evaluation package. (Named ``inspection``, not ``inspect``, so that it never shadows the standard
library's ``inspect``.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster import attention, checkpoints, hf, reports, steps
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError, one_line
from bert_cluster.reports import atomic_write, check_output, markdown_table, metadata_markdown

#: The temporary attention implementation name used while capturing (no "flash", no "/": see hf.py).
CAPTURE_NAME = "bert_cluster_inspect"

#: What ``inspect_model`` accepts as inputs besides tokenized tensors.
Texts = str | Sequence[str] | Sequence[tuple[str, str]]
#: The error budget per layer that ``bert-cluster inspect`` suggests layers for by default.
DEFAULT_MAX_ERROR = 0.1


@dataclasses.dataclass
class HeadReport:
    """The numbers of one attention head of one layer, over all inspected sequences."""

    layer: int
    head: int
    relative_error: float
    topk_mass: float | None
    clusters_used: float
    mean_cluster_size: float
    largest_cluster_share: float
    clustered_sequences: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Inspection:
    """Per layer and head comparison of clustered and exact attention (see the module docstring)."""

    config: ClusteredAttentionConfig
    sequences: int
    tokens: int
    heads: list[HeadReport]
    skipped_layers: list[int] = dataclasses.field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        """The inspected layer indices, ascending."""
        return sorted({report.layer for report in self.heads})

    @property
    def head_count(self) -> int:
        """Heads per layer."""
        return max((report.head for report in self.heads), default=-1) + 1

    def matrix(self, field: str) -> list[list[float | None]]:
        """``field`` as a layers x heads matrix (rows in ``layers`` order)."""
        index = {layer: row for row, layer in enumerate(self.layers)}
        out: list[list[float | None]] = [[None] * self.head_count for _ in self.layers]
        for report in self.heads:
            out[index[report.layer]][report.head] = getattr(report, field)
        return out

    def per_layer(self) -> list[dict[str, Any]]:
        """Each layer's numbers averaged over its heads (the worst head's error too)."""
        rows = []
        for layer in self.layers:
            reports = [report for report in self.heads if report.layer == layer]
            masses = [r.topk_mass for r in reports if r.topk_mass is not None]
            rows.append(
                {
                    "layer": layer,
                    "relative_error": _mean(r.relative_error for r in reports),
                    "worst_head_error": max(r.relative_error for r in reports),
                    "topk_mass": _mean(masses) if masses else None,
                    "clusters_used": _mean(r.clusters_used for r in reports),
                    "mean_cluster_size": _mean(r.mean_cluster_size for r in reports),
                    "largest_cluster_share": _mean(r.largest_cluster_share for r in reports),
                }
            )
        return rows

    def suggest_layers(self, max_error: float) -> tuple[int, ...]:
        """The layers to patch for an error budget: those whose mean relative error is at most ``max_error``.

        Errors compound through the layers that follow, so the budget is per layer, on exact inputs.
        """
        return tuple(row["layer"] for row in self.per_layer() if row["relative_error"] <= max_error)

    def summary(self, max_error: float = DEFAULT_MAX_ERROR) -> dict[str, Any]:
        """``to_dict()`` with the layers suggested for ``max_error`` (what ``inspect --json`` prints)."""
        return {
            **self.to_dict(),
            "suggested_layers": list(self.suggest_layers(max_error)),
            "max_error": max_error,
        }

    def advice(self, max_error: float = DEFAULT_MAX_ERROR) -> str:
        """One sentence: the inputs seen and the layers to pass as ``layers=`` for ``max_error``."""
        suggested = self.suggest_layers(max_error)
        layers = (
            f"{', '.join(map(str, suggested))} (convert(..., layers={list(suggested)}))"
            if suggested
            else "none (raise C or k, or --max-error)"
        )
        return (
            f"{self.sequences} sequences, {self.tokens} tokens. Layers with mean relative error <= "
            f"{max_error:g}: {layers}"
        )

    def table_title(self, per_head: bool = False) -> str:
        """The title of the table ``table_rows`` gives."""
        c = self.config
        return f"{c.mode}, C={c.clusters}, k={c.topk}: clustered vs exact attention, per layer" + (
            " and head" if per_head else " (mean over heads)"
        )

    def table_rows(self, per_head: bool = False) -> tuple[list[str], list[list[str]]]:
        """Header and rows of the table shared by inspect.md and the CLI: per layer, or per layer and head."""
        header = ["layer", *(["head"] if per_head else []), "rel. error"]
        header += [] if per_head else ["worst head"]
        header += ["top-k mass", "clusters used", "mean size", "largest %"]

        def mass(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        if per_head:
            rows = [
                [
                    str(h.layer),
                    str(h.head),
                    f"{h.relative_error:.4f}",
                    mass(h.topk_mass),
                    f"{h.clusters_used:.1f}",
                    f"{h.mean_cluster_size:.1f}",
                    f"{100 * h.largest_cluster_share:.1f}",
                ]
                for h in self.heads
            ]
        else:
            rows = [
                [
                    str(row["layer"]),
                    f"{row['relative_error']:.4f}",
                    f"{row['worst_head_error']:.4f}",
                    mass(row["topk_mass"]),
                    f"{row['clusters_used']:.1f}",
                    f"{row['mean_cluster_size']:.1f}",
                    f"{100 * row['largest_cluster_share']:.1f}",
                ]
                for row in self.per_layer()
            ]
        return header, rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, totals, per layer and per head numbers."""
        return {
            "config": self.config.to_dict(),
            "sequences": self.sequences,
            "tokens": self.tokens,
            "skipped_layers": list(self.skipped_layers),
            "layers": self.per_layer(),
            "heads": [report.to_dict() for report in self.heads],
        }

    def heatmap(self, path: str | Path) -> Path:
        """Write a PNG: relative error and top-k mass, layers x heads."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        panels = [("relative_error", "relative error of the output", "magma_r", None)]
        if any(report.topk_mass is not None for report in self.heads):
            panels.append(("topk_mass", "exact attention mass on the top-k keys", "viridis", (0.0, 1.0)))
        figure, axes = plt.subplots(
            1, len(panels), figsize=(4.8 * len(panels) + 0.6, 0.45 * len(self.layers) + 2.0), squeeze=False
        )
        for axis, (field, title, cmap, limits) in zip(axes[0], panels, strict=True):
            values = [[math.nan if v is None else v for v in row] for row in self.matrix(field)]
            vmin, vmax = limits or (0.0, max(max(row) for row in values) or 1.0)
            image = axis.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
            axis.set_title(title, fontsize=10)
            axis.set_xlabel("head")
            axis.set_ylabel("layer")
            axis.set_xticks(range(self.head_count))
            axis.set_yticks(range(len(self.layers)), [str(layer) for layer in self.layers])
            for row, line in enumerate(values):
                for column, value in enumerate(line):
                    if not math.isnan(value):
                        shade = (value - vmin) / ((vmax - vmin) or 1.0)
                        dark = shade > 0.55 if cmap == "magma_r" else shade < 0.45
                        axis.text(
                            column,
                            row,
                            f"{value:.2f}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white" if dark else "black",
                        )
            figure.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
        c = self.config
        detail = f"k={c.topk}, " if steps.MODES[c.mode].uses_topk else ""
        figure.suptitle(
            f"{c.mode}, C={c.clusters}, {detail}seed {c.seed}: "
            f"{self.sequences} sequences, {self.tokens} tokens",
            fontsize=10,
        )
        figure.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=130, format="png"))
        plt.close(figure)
        return path


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


# ---------------------------------------------------------------------------------------------------
# The clustering steps of one layer, as attention._clustered composes them, keeping what inspection needs.


def cluster_steps(
    backend: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    config: ClusteredAttentionConfig,
    clusters: int,
    topk: int,
    scaling: float,
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partition and top-k keys of rows that are all clustered: ``attention.partition``'s.

    Returns assignments ``(R, H, N)``, cluster sizes ``(R, H, C)`` and top-k indices ``(R, H, C, k)`` for
    ``config.mode``, with the row settings ``clusters`` and ``topk`` (``config.row_settings``).
    ``tests/test_inspect.py`` checks that refining with them reproduces ``clustered_attention``.
    """
    settings = attention.step_arguments(config, clusters, topk, scaling, layer, query)
    steps = attention.partition(backend, query, key, value, valid, *settings)
    return steps.assignments, steps.counts, steps.topk_indices


class _Totals:
    """Running sums per (layer, head) while batches go through the model."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, int], dict[str, float]] = {}

    def add(self, layer: int, head: int, **values: float) -> None:
        slot = self.sums.setdefault((layer, head), {})
        for name, value in values.items():
            slot[name] = slot.get(name, 0.0) + float(value)

    def reports(self, with_mass: bool) -> list[HeadReport]:
        out = []
        for (layer, head), s in sorted(self.sums.items()):
            clustered = s.get("clustered", 0.0)
            mass = s.get("mass", 0.0) / s["mass_queries"] if with_mass and s.get("mass_queries") else None
            if with_mass and not s.get("mass_queries"):
                mass = 1.0  # every row was short: exact attention, all of the mass is exact
            out.append(
                HeadReport(
                    layer=layer,
                    head=head,
                    relative_error=math.sqrt(s["error"] / s["norm"]) if s["norm"] > 0 else 0.0,
                    topk_mass=mass,
                    clusters_used=s.get("used", 0.0) / clustered if clustered else 0.0,
                    mean_cluster_size=s.get("size", 0.0) / clustered if clustered else 0.0,
                    largest_cluster_share=s.get("largest", 0.0) / clustered if clustered else 0.0,
                    clustered_sequences=int(clustered),
                )
            )
        return out


def inspect_layer(
    totals: _Totals,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    config: ClusteredAttentionConfig,
    scaling: float,
) -> None:
    """Add one layer's numbers for one batch ``(R, H, N, D)`` to ``totals``.

    Rows are routed as ``clustered_attention`` routes them (its plan: short rows exact, the others with
    their row settings of C and k).
    """
    approximate = attention.clustered_attention(
        query, key, value, valid, config, scaling=scaling, layer=layer
    )
    plan = attention._plan(query, key, value, valid, config, scaling)
    lengths = valid.sum(-1)
    rows, heads, n, _ = query.shape
    steps: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for members, clusters, topk in plan.groups:
        index = plan.index(members)
        found = cluster_steps(
            plan.backend,
            *(t.index_select(0, index) for t in (query, key, value, valid)),
            config,
            clusters,
            topk,
            scaling,
            layer,
        )
        for local, row in enumerate(members):
            steps[row] = tuple(part[local] for part in found)  # type: ignore[assignment]
    for row in range(rows):
        m = int(lengths[row])
        keep = valid[row]
        q, k, v = (t[row][:, keep].float() for t in (query, key, value))  # (H, m, D)
        weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scaling, dim=-1)  # (H, m, m)
        exact = torch.matmul(weights, v)
        error = (approximate[row][:, keep].float() - exact).pow(2).sum((-1, -2))
        norm = exact.pow(2).sum((-1, -2))
        position = torch.full((n,), -1, dtype=torch.long, device=query.device)
        position[keep] = torch.arange(m, device=query.device)  # key index -> column among valid keys
        for head in range(heads):
            values: dict[str, float] = {"error": error[head], "norm": norm[head]}
            if row in steps:
                assign, counts, indices = (part[head] for part in steps[row])
                members = counts[counts > 0]
                values.update(
                    clustered=1.0,
                    used=members.numel(),
                    size=float(members.mean()),
                    largest=float(members.max()) / m,
                )
                if indices.shape[-1] > 0:
                    top = indices[assign[keep]]  # (m, k): each valid query's cluster top-k keys
                    columns = position[top.clamp(min=0)]
                    mass = (weights[head].gather(-1, columns.clamp(min=0)) * (top >= 0)).sum(-1)
                    values.update(mass=float(mass.sum()), mass_queries=float(m))
            totals.add(layer, head, **values)


# ---------------------------------------------------------------------------------------------------
# Capturing q, k, v from a transformers model through its attention interface.


class _Recorder:
    """Collects each layer's (query, key, value, valid, scaling) during one forward pass."""

    def __init__(self, layer_of: Mapping[int, int]) -> None:
        self.layer_of = layer_of
        self.captured: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
        self.skipped: set[int] = set()


_ACTIVE: list[_Recorder] = []


def _capture_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Record the inputs, then run exact attention (SDPA) so the model's activations stay exact."""
    recorder = _ACTIVE[-1]
    batch, heads, length, head_dim = query.shape
    window = kwargs.get("sliding_window")
    half_window = None if window is None else int(window) - 1
    layer = recorder.layer_of[id(module)]
    if window is not None or key.shape[-2] != length:
        recorder.skipped.add(layer)  # a band or cross-attention layer: not clustered by convert
    else:
        valid = hf.valid_from_mask(attention_mask, batch, length)
        if valid is None:
            valid = torch.ones(batch, length, dtype=torch.bool, device=query.device)
        k, v = key, value
        if k.shape[1] != heads:  # grouped-query attention, as convert's glue expands it
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        scale = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
        recorder.captured.append((layer, query.detach(), k.detach(), v.detach(), valid, scale))
    return hf.original_attention(
        module, "sdpa", query, key, value, attention_mask, half_window,
        {**kwargs, "scaling": scaling, "dropout": 0.0},
    )  # fmt: skip


def _register_capture() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_NAME, _capture_forward)
    AttentionMaskInterface.register(CAPTURE_NAME, hf.key_padding_mask)


def _batches(encoded: Mapping[str, torch.Tensor], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    total = encoded["input_ids"].shape[0]
    for start in range(0, total, batch_size):
        yield {name: tensor[start : start + batch_size] for name, tensor in encoded.items()}


def _encode(tokenizer: Any, inputs: Any, max_length: int) -> dict[str, torch.Tensor]:
    """Tokenize texts (or text pairs) with padding; tensors pass through."""
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError("tokenized inputs must hold input_ids (and attention_mask for padding)")
        return dict(inputs)
    if tokenizer is None:
        raise ValueError("texts need a tokenizer: pass tokenizer=")
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    if not texts:
        raise ValueError("no inputs to inspect: give at least one text")
    if all(isinstance(text, str) for text in texts):
        return dict(
            tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        )
    if all(isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in texts):
        first, second = zip(*texts, strict=True)
        return dict(
            tokenizer(
                list(first),
                list(second),
                padding=True,
                truncation="longest_first",
                max_length=max_length,
                return_tensors="pt",
            )
        )
    raise TypeError(
        "inputs must be a text, a list of texts, a list of (text, text) pairs or tokenized tensors"
    )


def inspect_model(
    model: Any,
    inputs: Any,
    tokenizer: Any = None,
    config: ClusteredAttentionConfig | None = None,
    *,
    max_length: int = 512,
    batch_size: int = 8,
    **settings: Any,
) -> Inspection:
    """Compare clustered and exact attention in every self-attention layer of ``model`` on ``inputs``.

    Args:
        model: a transformers ``PreTrainedModel`` of a family ``convert`` supports (converted or not).
        inputs: a text, a list of texts, a list of (text, text) pairs, or tokenized tensors
            (``input_ids``, ``attention_mask``, ...).
        tokenizer: the model's tokenizer (needed for texts).
        config: the clustered attention settings to inspect. Default: the model's own (when converted),
            else ``ClusteredAttentionConfig()``; keyword ``settings`` (``clusters=10``, ``mode=...``) are
            applied on top.
        max_length: truncation length for texts.
        batch_size: sequences per forward pass.

    Returns:
        An ``Inspection``: per head relative error, top-k mass and cluster sizes.
    """
    hf.check_model(model)
    if config is None:
        stored = getattr(model.config, hf.SETTINGS_KEY, None)
        config = hf.settings_of(model.config)[0] if isinstance(stored, dict) else ClusteredAttentionConfig()
    elif not isinstance(config, ClusteredAttentionConfig):
        raise TypeError(f"config must be a ClusteredAttentionConfig, got {type(config).__name__}")
    if settings:
        config = config.replace(**settings)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    encoded = _encode(tokenizer, inputs, max_length)
    device = next(model.parameters()).device
    # The layer indices convert gives (the same hash planes as the converted model).
    layer_of = {key: index for key, (_, index) in hf.layer_indices(model).items()}
    _register_capture()
    previous = model.config._attn_implementation
    totals, sequences, tokens, skipped = _Totals(), 0, 0, set()
    recorder = _Recorder(layer_of)
    _ACTIVE.append(recorder)
    try:
        model.set_attn_implementation(CAPTURE_NAME)
        if model.config._attn_implementation != CAPTURE_NAME:
            raise ValueError(f"transformers did not switch {type(model).__name__} to the capture attention")
        with torch.inference_mode():
            for batch in _batches(encoded, batch_size):
                batch = {name: tensor.to(device) for name, tensor in batch.items()}
                recorder.captured.clear()
                model(**batch)
                if not recorder.captured and not recorder.skipped:
                    raise ValueError(
                        f"{type(model).__name__} ran no attention through transformers' AttentionInterface"
                    )
                mask = batch.get("attention_mask")
                sequences += batch["input_ids"].shape[0]
                tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
                for layer, query, key, value, valid, scaling in recorder.captured:
                    inspect_layer(totals, layer, query, key, value, valid, config, scaling)
        skipped = recorder.skipped
    finally:
        _ACTIVE.remove(recorder)
        model.set_attn_implementation(previous)
    return Inspection(
        config=config,
        sequences=sequences,
        tokens=tokens,
        heads=totals.reports(with_mass=steps.MODES[config.mode].uses_topk),
        skipped_layers=sorted(skipped),
    )


def inspect_checkpoint(
    model: str | Path,
    inputs: Any,
    config: ClusteredAttentionConfig | None = None,
    *,
    max_length: int = 512,
    max_error: float = DEFAULT_MAX_ERROR,
    output: str | Path | None = None,
    overwrite: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> Inspection:
    """``inspect_model`` on a checkpoint path (its encoder; any head), writing the report to ``output``.

    ``output`` is checked before the model is loaded: it must be empty or new, as for ``evaluate``;
    ``overwrite`` allows a folder that holds files (an earlier report's inspect.* are replaced, nothing
    else is touched). ``settings`` are recorded beside the config in inspect.json. What ``bert-cluster
    inspect`` calls.

    Raises:
        UserError: the model cannot be loaded, or ``output`` is not empty (without ``overwrite``) or
            cannot be written.
    """
    if output is not None:
        check_output(output, overwrite=overwrite)
    loaded, tokenizer = checkpoints.load_encoder(model)
    report = inspect_model(loaded, inputs, tokenizer, config, max_length=max_length)
    if output is not None:
        run = {"max_length": max_length, **(settings or {})}
        write(report, output, model=str(model), max_error=max_error, settings=run)
    return report


def load_text_file(path: str | Path, limit: int = 16) -> list[str]:
    """The first ``limit`` non-empty lines of a UTF-8 text file, stripped: one input per line.

    Raises:
        UserError: the file is missing, unreadable or has no non-empty line.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"input file {path} does not exist or is not a file")
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read input file {path}: {one_line(error)}") from None
    inputs = [line for line in lines if line][:limit]
    if not inputs:
        raise UserError(f"input file {path} has no non-empty line")
    return inputs


def markdown(
    report: Inspection,
    max_error: float = DEFAULT_MAX_ERROR,
    model: str | None = None,
    settings: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
) -> str:
    """inspect.md: the suggested layers, the per-layer and per-head tables, the settings and environment."""
    lines = [f"# bert-cluster inspect: {model}" if model else "# bert-cluster inspect", ""]
    lines += [f"{report.advice(max_error)}.", ""]
    if report.skipped_layers:
        lines += [f"Not inspected (sliding-window or cross-attention): layers {report.skipped_layers}.", ""]
    for per_head in (False, True):
        header, rows = report.table_rows(per_head)
        lines += [f"## {report.table_title(per_head)}", "", *markdown_table(header, rows, 1), ""]
    if settings is not None and environment is not None:
        lines += metadata_markdown(settings, environment)
    return "\n".join(lines)


#: What ``write`` puts in its folder: JSON, markdown, heatmap.
FILES = ("inspect.json", "inspect.md", "inspect.png")


def write(
    report: Inspection,
    folder: str | Path,
    *,
    model: str,
    max_error: float = DEFAULT_MAX_ERROR,
    settings: Mapping[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Path]:
    """Write inspect.json (``summary`` plus model, settings, environment), inspect.md and inspect.png.

    Through the one report writer (``bert_cluster.reports.write_report``), as evaluate's and
    tune's reports are; ``settings`` adds to the recorded settings (the inputs, ``max_length``).
    """
    run = {"model": model, "max_error": max_error, **(settings or {}), "config": report.config.to_dict()}
    environment = reports.environment(device)
    document = {**report.summary(max_error), "model": model, "settings": run, "environment": environment}
    return reports.write_report(
        folder,
        reports.ReportFiles(*FILES),
        document,
        markdown(report, max_error, model, run, environment),
        plot=report.heatmap,
    )


__all__ = [
    "DEFAULT_MAX_ERROR",
    "FILES",
    "HeadReport",
    "Inspection",
    "cluster_steps",
    "inspect_checkpoint",
    "inspect_layer",
    "inspect_model",
    "load_text_file",
    "markdown",
    "write",
]
