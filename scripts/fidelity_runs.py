"""Score attention modes against the unmodified model with the product's runner, in a chosen order.

``bert-cluster evaluate`` runs mode x C x seed in a fixed order and writes results.json at the end of
each configuration; on a busy machine the comparison that matters (the same C and seed in two modes)
should come first. This script takes an explicit list of ``MODE:C:SEED`` runs, scores them in that order
on one ``TaskSession`` (the runner's own loading and scoring, one unmodified pass), and rewrites its JSON
after every run, so that it can be stopped at any point. Prints each run as it ends and a summary table.

    python scripts/fidelity_runs.py /tmp/models/minilm-l6-squad --task squad \\
        --data-dir ../shared/models/minilm-l6-squad/eval --limit 1000 \\
        --runs i-clustered:25:0 i-clustered+:25:0 i-clustered:10:0 i-clustered+:10:0 \\
        --output docs/results/squad_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.evaluation.runner import TaskSession
from bert_cluster.tasks.config import get_tasks


def parse_run(text: str) -> tuple[str, int, int]:
    """``i-clustered+:25:0`` -> ``("i-clustered+", 25, 0)``."""
    mode, clusters, seed = text.rsplit(":", 2)
    return mode, int(clusters), int(seed)


def summarise(unmodified: dict, runs: list[dict]) -> list[dict]:
    """Mean and spread of each metric's change from unmodified, per (mode, C), over the seeds run."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["mode"], run["clusters"]), []).append(run)
    rows = []
    for (mode, clusters), members in groups.items():
        row = {"mode": mode, "clusters": clusters, "seeds": [m["seed"] for m in members]}
        for metric, base in unmodified["scores"].items():
            deltas = [m["scores"][metric] - base for m in members]
            row[f"{metric}_delta"] = statistics.fmean(deltas)
            row[f"{metric}_delta_std"] = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
        row["wall_time_s"] = statistics.fmean(m["wall_time_s"] for m in members)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--task", default="squad")
    parser.add_argument("--data-dir", type=Path, action="append", default=[])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--topk", type=int, default=ClusteredAttentionConfig().topk)
    parser.add_argument("--runs", nargs="+", type=parse_run, required=True, help="MODE:C:SEED, in order")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    (task,) = get_tasks(args.task)
    session = TaskSession(task, args.model, data_dirs=args.data_dir, limit=args.limit)
    record = {
        "task": task.name,
        "model": args.model,
        "examples": session.examples.count,
        "limit": args.limit,
        "topk": args.topk,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "runs": [],
    }

    def write() -> None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        record["load_average_1m"] = os.getloadavg()[0]
        if "unmodified" in record:
            record["summary"] = summarise(record["unmodified"], record["runs"])
        args.output.write_text(json.dumps(record, indent=2), encoding="utf-8")

    def as_dict(run) -> dict:
        return {
            "mode": run.mode,
            "clusters": run.clusters,
            "seed": run.seed,
            "scores": run.scores,
            "wall_time_s": run.wall_time_s,
            "backend": run.backend,
            "load_average_1m": os.getloadavg()[0],
        }

    record["unmodified"] = as_dict(session.score(None))
    write()
    print(
        f"unmodified {record['unmodified']['scores']} ({record['unmodified']['wall_time_s']:.0f} s)",
        flush=True,
    )
    for mode, clusters, seed in args.runs:
        config = ClusteredAttentionConfig(clusters=clusters, topk=args.topk, mode=mode, seed=seed)
        run = as_dict(session.score(config))
        record["runs"].append(run)
        write()
        changes = {k: round(v - record["unmodified"]["scores"][k], 2) for k, v in run["scores"].items()}
        print(
            f"{mode} C={clusters} seed={seed}: {run['scores']} change {changes} ({run['wall_time_s']:.0f} s)",
            flush=True,
        )
    for row in record.get("summary", []):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
