"""Screen candidate improvements of i-clustered attention (issue 13): SQuAD F1 change and time.

Each candidate is a composition of the paper's steps (the compiled kernels where they exist) with one
or more changes written here in plain PyTorch:

* ``lloyd<L>``: L Lloyd rounds on the real query vectors after the Hamming K-means (the
  ``lloyd_refine`` step of mode i-clustered+, on the chosen backend);
* ``mass<P>``: each cluster keeps its top keys, by centroid attention, until they cover P % of the
  centroid's mass (at most ``--max-topk`` keys) instead of a fixed k;
* ``qmass``: each query's own mass on its cluster's top-k keys (``reference.refine_with_query_mass``)
  instead of the centroid's;
* ``sinks<S>``: the S keys with the most attention (cluster-size-weighted centroid mass) are recomputed
  exactly for every cluster, on top of its own top-k;
* ``+`` combines them, e.g. ``lloyd3+mass90``; ``base`` is the paper's i-clustered attention.

The model, its windows and the unmodified score are loaded once; every candidate then runs at every
cluster count on the same questions. Time: median over interleaved repeats of the attention call alone
(batch 1, 12 heads, ``benchmarks.attention``'s shape) at each N, as a ratio to ``base`` in the same run; the
steps written here in PyTorch are slower than a kernel would be, so that ratio bounds the cost from above.
Prints a table and writes JSON.

    python -m benchmarks.fidelity_screen /tmp/w4-models/minilm-l6-squad \\
        --data-dir ../shared/models/minilm-l6-squad/eval --limit 1000 --clusters 10,25 \\
        --candidates base lloyd3 mass90 sinks4 lloyd3+mass90 --output docs/results/fidelity_screen.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import (
    environment,
    signed,
    table_lines,
    time_rounds,
)
from bert_cluster import attention, reference
from bert_cluster.config import ClusteredAttentionConfig

_PART = re.compile(r"^(lloyd|mass|sinks|k|hamming)(\d+)$|^(qmass)$")


def parse_candidate(name: str) -> dict[str, int]:
    """``lloyd3+mass90`` -> ``{"lloyd": 3, "mass": 90}``; ``base`` -> ``{}``."""
    if name == "base":
        return {}
    parts = {}
    for part in name.split("+"):
        match = _PART.match(part)
        if match is None:
            raise ValueError(
                f"bad candidate part {part!r} in {name!r}: use base or lloyd<L>, mass<P>, sinks<S>, "
                "k<K>, hamming<L>, qmass joined by +"
            )
        if match.group(3):
            parts[match.group(3)] = 1
        else:
            parts[match.group(1)] = int(match.group(2))
    return parts


def _keep_by_mass(centroids, keys, values, indices, mass, share: float, scaling: float):
    """Cut each cluster's top keys (sorted by score) once they cover ``share`` of the centroid's mass."""
    top_keys = reference.gather_rows(keys.float(), indices)
    scores = torch.einsum("rhcd,rhckd->rhck", centroids, top_keys) * scaling
    scores = scores.masked_fill(indices < 0, -math.inf)
    weights = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) * mass[..., None]
    before = torch.cumsum(weights, -1) - weights
    keep = (before < share) & (indices >= 0)
    weights = weights * keep
    indices = torch.where(keep, indices, torch.full_like(indices, -1))
    top_values = torch.einsum("rhck,rhckd->rhcd", weights, reference.gather_rows(values.float(), indices))
    return indices, weights.sum(-1), top_values, keep.sum(-1).float()


def _add_sinks(centroids, counts, keys, values, valid, indices, sinks: int, scaling: float):
    """Add the ``sinks`` most attended keys of each head to every cluster's exact set."""
    scores = torch.matmul(centroids, keys.float().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    weights = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)  # (R, H, C, N)
    load = (counts[..., None] * weights).sum(-2).masked_fill(~valid[:, None, :], -1.0)
    sink = load.topk(min(sinks, keys.shape[-2]), dim=-1).indices  # (R, H, S)
    sink = sink[:, :, None, :].expand(-1, -1, indices.shape[2], -1)
    duplicate = (sink[..., :, None] == indices[..., None, :]).any(-1)
    sink = torch.where(duplicate, torch.full_like(sink, -1), sink)
    sink = torch.where(valid.gather(1, sink.clamp(min=0).flatten(1)).view_as(sink), sink, -1)
    merged = torch.cat([indices, sink], -1)
    picked = weights.gather(-1, merged.clamp(min=0)) * (merged >= 0)
    top_values = torch.einsum("rhck,rhckd->rhcd", picked, reference.gather_rows(values.float(), merged))
    return merged, picked.sum(-1), top_values


#: Filled by the candidate pipeline: keys recomputed per cluster (mean over calls), a cost proxy.
KEY_STATS: list[float] = []


def make_pipeline(parts: dict[str, int], max_topk: int) -> Callable:
    """The paper's steps with the candidate ``parts``, for ``attention.replaced_steps``."""

    def pipeline(backend, query, key, value, valid, config, clusters, topk, scaling, layer):
        planes, offsets = attention.hash_planes(
            config.seed, layer, config.bits, query.shape[-1], query.device
        )
        hashes = backend.hash_queries(query, planes, offsets)
        iterations = parts.get("hamming", config.iterations)
        assignments, _ = backend.hamming_kmeans(hashes, valid, clusters, iterations, config.bits)
        if "lloyd" in parts:
            assignments, centroids, counts = backend.lloyd_refine(
                query, assignments, clusters, parts["lloyd"]
            )
        else:
            centroids, counts = backend.group_queries(query, assignments, clusters)
        topk = parts.get("k", topk)
        if "mass" in parts:
            topk = max(topk, max_topk)
        centroid_values, indices, mass, top_values = backend.centroid_attention(
            centroids, key, value, valid, topk, scaling
        )
        if "qmass" in parts:
            KEY_STATS.append(float((indices >= 0).sum(-1).float().mean()))
            return reference.refine_with_query_mass(
                query,
                key,
                value,
                valid,
                assignments,
                centroids,
                centroid_values,
                indices,
                mass,
                top_values,
                scaling,
            )
        if "mass" in parts:
            indices, mass, top_values, kept = _keep_by_mass(
                centroids, key, value, indices, mass, parts["mass"] / 100.0, scaling
            )
            present = counts > 0
            KEY_STATS.append(float(kept[present].mean()))
        else:
            KEY_STATS.append(float((indices >= 0).sum(-1).float().mean()))
        if "sinks" in parts:
            indices, mass, top_values = _add_sinks(
                centroids, counts, key, value, valid, indices, parts["sinks"], scaling
            )
        return backend.topk_refine(
            query, key, value, assignments, centroid_values, indices, mass, top_values, scaling
        )

    return pipeline


def score_candidates(args) -> tuple[dict, list[dict]]:
    """SQuAD scores: unmodified once, then each candidate at each C."""
    from bert_cluster.evaluation.runner import TaskSession
    from bert_cluster.tasks.config import get_tasks

    (task,) = get_tasks("squad")
    session = TaskSession(
        task, str(args.model), data_dirs=[args.data_dir], limit=args.limit, batch_size=args.batch_size
    )

    def score(config: ClusteredAttentionConfig | None) -> tuple[dict[str, float], float]:
        run = session.score(config)  # converts, scores, reverts
        return run.scores, run.wall_time_s

    unmodified, seconds = score(None)
    print(f"unmodified: F1 {unmodified['f1']:.2f} EM {unmodified['exact']:.2f} ({seconds:.0f} s)", flush=True)
    rows = []
    for name in args.candidates:
        parts = parse_candidate(name)
        for clusters in args.clusters:
            KEY_STATS.clear()
            config = ClusteredAttentionConfig(clusters=clusters, topk=args.topk, seed=args.seed)
            with attention.replaced_steps(make_pipeline(parts, args.max_topk)):
                scores, seconds = score(config)
            row = {
                "candidate": name,
                "clusters": clusters,
                "f1": scores["f1"],
                "exact": scores["exact"],
                "f1_change": scores["f1"] - unmodified["f1"],
                "exact_change": scores["exact"] - unmodified["exact"],
                "mean_keys_per_cluster": statistics.fmean(KEY_STATS) if KEY_STATS else None,
                "eval_seconds": seconds,
            }
            rows.append(row)
            print(
                f"{name:>20} C={clusters:<3} F1 {row['f1']:.2f} ({row['f1_change']:+.2f}) "
                f"EM {row['exact']:.2f} ({row['exact_change']:+.2f}) "
                f"keys/cluster {row['mean_keys_per_cluster']:.1f} ({seconds:.0f} s)",
                flush=True,
            )
            if args.output:
                _write(args, unmodified, rows, {})
    return unmodified, rows


def time_candidates(args) -> dict:
    """Attention time of each candidate at each N relative to ``base`` (median of interleaved repeats)."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    torch.set_num_threads(args.threads)
    config = ClusteredAttentionConfig(clusters=25, topk=args.topk, seed=args.seed)

    def run(pipeline: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        with attention.replaced_steps(pipeline):
            attention.clustered_attention(q, k, v, config=config)

    with torch.inference_mode():
        for n in args.lengths:
            q, k, v = (torch.randn(1, 12, n, 64, generator=generator) for _ in range(3))
            calls = {
                name: functools.partial(run, make_pipeline(parse_candidate(name), args.max_topk), q, k, v)
                for name in args.candidates
            }
            for call in calls.values():  # a warm-up round
                call()
            times = time_rounds(calls, args.repeats)
            base = statistics.median(times["base"]) if "base" in times else float("nan")
            out[str(n)] = {
                name: {"median_ms": 1e3 * statistics.median(t), "ratio_to_base": statistics.median(t) / base}
                for name, t in times.items()
            }
            print(f"N={n}: " + ", ".join(f"{k} {v['ratio_to_base']:.2f}x" for k, v in out[str(n)].items()))
    return out


def _write(args, unmodified, rows, timing) -> None:
    machine = environment(args.threads)
    result = {
        "date": machine["date"],
        "machine": {key: machine[key] for key in ("platform", "threads")},
        "torch": machine["torch"],
        "model": str(args.model),
        "data": str(args.data_dir),
        "questions": args.limit,
        "seed": args.seed,
        "topk": args.topk,
        "max_topk_for_mass": args.max_topk,
        "unmodified": unmodified,
        "rows": rows,
        "timing": timing,
        "timing_note": (
            "attention call alone, batch 1, 12 heads, head dim 64, C=25; median of interleaved repeats; "
            "ratio to base (the paper's i-clustered on the same backend) in the same run; candidate steps "
            "written in PyTorch here, so the ratio bounds a kernel's cost from above"
        ),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path, nargs="?", help="a SQuAD checkpoint folder")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/models/minilm-l6-squad/eval"))
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--clusters", type=lambda s: [int(x) for x in s.split(",")], default=[10, 25])
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--max-topk", type=int, default=64, help="cap of the mass<P> candidates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--candidates", nargs="+", default=["base", "lloyd3", "mass90", "sinks4"])
    parser.add_argument("--lengths", type=int, nargs="*", default=[384, 4096], help="none: skip timing")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timing-only", action="store_true")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    for name in args.candidates:
        parse_candidate(name)
    torch.set_num_threads(args.threads)
    unmodified, rows = {}, []
    if not args.timing_only:
        if args.model is None:
            parser.error("give a SQuAD checkpoint folder (or --timing-only)")
        unmodified, rows = score_candidates(args)
    timing = time_candidates(args) if args.lengths else {}
    if args.output:
        _write(args, unmodified, rows, timing)
        print(f"wrote {args.output}")


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def table(results: list[dict]) -> list[str]:
    (result,) = results
    candidates = list(dict.fromkeys(r["candidate"] for r in result["rows"]))
    clusters = sorted({r["clusters"] for r in result["rows"]})
    rows = []
    for candidate in candidates:
        found = {r["clusters"]: r for r in result["rows"] if r["candidate"] == candidate}
        keys = sorted({f"{found[c]['mean_keys_per_cluster']:.0f}" for c in clusters if c in found})
        rows.append(
            [candidate]
            + [signed(found[c]["f1_change"]) if c in found else "" for c in clusters]
            + ["-".join(keys)]
        )
    header = ["candidate"] + [f"F1 change C = {c}" for c in clusters] + ["keys per cluster"]
    caption = (
        f"first {result['questions']:,} held-out questions, seed {result['seed']}, k = {result['topk']}; "
        "unmodified "
        f"F1 {result['unmodified']['f1']:.2f}, EM {result['unmodified']['exact']:.2f}."
    )
    return table_lines(header, "l" + "r" * (len(header) - 1), rows) + ["", caption]


if __name__ == "__main__":
    sys.exit(main())
