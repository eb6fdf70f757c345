"""Score attention modes against the unmodified model with the product's runner, in a chosen order.

``bert-cluster evaluate`` runs mode x C x seed in a fixed order and writes results.json at the end of
each configuration; on a busy machine the comparison that matters (the same C and seed in two modes)
should come first. This script takes an explicit list of ``MODE:C:SEED`` runs, scores them in that order
on one ``TaskSession`` (the runner's own loading and scoring, one unmodified pass), and rewrites its JSON
after every run, so that it can be stopped at any point. Prints each run as it ends and a summary table.

    python -m benchmarks.fidelity_runs /tmp/models/minilm-l6-squad --task squad \\
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
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.harness import mean_std, signed, table_lines, times
from bert_cluster.attention import plus_lloyd_rounds
from bert_cluster.config import ClusteredAttentionConfig


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

    import torch

    from bert_cluster.evaluation.runner import TaskSession
    from bert_cluster.tasks.config import get_tasks

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


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def squad_table(results: list[dict], specs: Sequence[Sequence]) -> list[str]:
    """specs: (source index, mode, C, the runs' recorded lloyd_rounds or None, the rounds they ran)."""
    base = results[0]["unmodified"]["scores"]
    rows = []
    for index, mode, clusters, recorded, rounds in specs:
        runs = [
            r
            for r in results[index]["runs"]
            if r["mode"] == mode and r["clusters"] == clusters and r.get("lloyd_rounds") == recorded
        ]
        em = [r["scores"]["exact"] for r in runs]
        f1 = [r["scores"]["f1"] for r in runs]
        default = mode == "i-clustered+" and rounds == plus_lloyd_rounds(clusters)
        name = f"**{mode}** (default)" if default else mode
        f1_change = mean_std([v - base["f1"] for v in f1])
        rows.append(
            [
                name,
                str(clusters),
                "–" if rounds is None else str(rounds),
                ", ".join(str(r["seed"]) for r in runs),
                f"{statistics.mean(em):.2f}",
                f"{statistics.mean(f1):.2f}",
                mean_std([v - base["exact"] for v in em]),
                f"**{f1_change}**" if default else f1_change,
            ]
        )
    header = ["mode", "C", "Lloyd rounds", "seeds", "EM", "F1", "EM change", "F1 change"]
    caption = (
        f"{results[0]['examples']:,} questions, k = {results[0]['topk']}, `min_length=0`; unmodified EM "
        f"{base['exact']:.2f}, F1 {base['f1']:.2f}; mean ± sample std over the seeds."
    )
    return table_lines(header, "lrrlrrrr", rows) + ["", caption]


def task_runs(result: dict, task: str) -> list[dict]:
    return next(t for t in result["tasks"] if t["task"] == task)["runs"]


def metric_names(result: dict, task: str) -> list[tuple[str, str]]:
    entry = next(t for t in result["tasks"] if t["task"] == task)
    return [(m["name"], m["display"]) for m in entry["metrics"]]


def evaluate_table(
    results: list[dict],
    tasks: Sequence[str],
    columns: Sequence[Sequence],
    skip: Sequence[Sequence] = (),
) -> list[str]:
    """Unmodified and one column per (heading, source index, mode, C), one seed; the change in brackets.

    skip: (source index, task) pairs whose runs are superseded by another column's.
    """
    skipped = {tuple(pair) for pair in skip}

    def shown(results: list[dict], index: int, task: str) -> bool:
        return (index, task) not in skipped and any(t["task"] == task for t in results[index]["tasks"])

    rows = []
    for task in tasks:
        owner = next(r for r in results if any(t["task"] == task for t in r["tasks"]))
        unmodified = task_runs(owner, task)[0]["scores"]
        for metric, display in metric_names(owner, task):
            row = [task, display, f"{unmodified[metric]:.2f}"]
            for _, index, mode, clusters in columns:
                if not shown(results, index, task):
                    row.append("")
                    continue
                run = next(
                    r
                    for r in task_runs(results[index], task)
                    if r["mode"] == mode and r["clusters"] == clusters
                )
                value = run["scores"][metric]
                row.append(f"{value:.2f} ({value - unmodified[metric]:+.2f})")
            rows.append(row)
    speed = ["", "speedup", "1.00×"]
    for _, index, mode, clusters in columns:
        found = [
            f"{task} {times(run['speedup'])}"
            for task in tasks
            if shown(results, index, task)
            for run in task_runs(results[index], task)
            if run["mode"] == mode and run["clusters"] == clusters
        ]
        speed.append(", ".join(found))
    rows.append(speed)
    header = ["task", "metric", "unmodified"] + [c[0] for c in columns]
    cpus = sorted({r["environment"]["hardware"]["cpu"] for r in results})
    dates = sorted({r["started"][:10] for r in results})
    threads = results[0]["environment"]["hardware"]["torch_threads"]
    caption = f"{'; '.join(cpus)}, {threads} threads; runs of {', '.join(dates)}."
    return table_lines(header, "llr" + "r" * len(columns), rows) + ["", caption]


def seeds_table(results: list[dict]) -> list[str]:
    """i-clustered across C with three seeds (0.1's runs): mean ± std (change)."""
    rows = []
    for result in results:
        for entry in result["tasks"]:
            runs = entry["runs"]
            unmodified = runs[0]["scores"]
            settings = sorted({r["clusters"] for r in runs[1:]})
            for metric, display in ((m["name"], m["display"]) for m in entry["metrics"]):
                row = [entry["task"], display, f"{unmodified[metric]:.2f}"]
                for clusters in settings:
                    values = [r["scores"][metric] for r in runs[1:] if r["clusters"] == clusters]
                    mean = statistics.mean(values)
                    row.append(
                        f"{mean:.2f} ± {statistics.stdev(values):.2f} ({mean - unmodified[metric]:+.2f})"
                    )
                rows.append(row)
    header = ["task", "metric", "unmodified"] + [f"C={c}" for c in settings]
    seeds = sorted({r["seed"] for res in results for t in res["tasks"] for r in t["runs"][1:]})
    caption = (
        f"mode i-clustered (0.1), k = {results[0]['settings']['attention']['topk']}, seeds "
        f"{', '.join(map(str, seeds))} (mean ± sample std, the change in brackets); "
        f"{results[0]['environment']['hardware']['cpu']}; {results[0]['started'][:10]}."
    )
    return table_lines(header, "llr" + "r" * len(settings), rows) + ["", caption]


#: articles_8k.json's run names from before 0.2's growth was chosen (its "default" was a candidate then).
ARTICLE_SETTINGS = {
    "default (i-clustered+, cg 0.5, kg 0.25)": "i-clustered+, growth 0.5 / 0.25",
    "i-clustered, cg 0.75, kg 0.5 (former default)": "i-clustered, growth 0.75 / 0.5 (0.1's default)",
    "i-clustered+, cg 0.5, kg 0.5": "**i-clustered+, growth 0.5 / 0.5 (0.2's default)**",
}


def articles_table(results: list[dict]) -> list[str]:
    (result,) = results
    rows = []
    base = result["runs"]["unmodified"]["scores"]
    for label, run in result["runs"].items():
        scores = run["scores"]
        change = "" if label == "unmodified" else f"{scores['recall@1'] - base['recall@1']:+.2f}"
        rows.append(
            [
                ARTICLE_SETTINGS.get(label, label),
                f"{scores['recall@1']:.2f}",
                f"{scores['recall@5']:.2f}",
                f"{scores['mrr@10']:.2f}",
                change,
            ]
        )
    caption = (
        f"{result['model']}, {result['limit']:,} questions, documents truncated at "
        f"{result['max_length']:,} tokens; {result['note']}."
    )
    return table_lines(["setting", "R@1", "R@5", "MRR@10", "R@1 change"], "lrrrr", rows) + ["", caption]


def inspect_table(results: list[dict]) -> list[str]:
    header = ["layer"]
    for result in results:
        header += [f"{result['config']['mode']}: rel. error (worst head)", "top-k mass"]
    rows = []
    for index in range(len(results[0]["layers"])):
        row = [str(results[0]["layers"][index]["layer"])]
        for result in results:
            layer = result["layers"][index]
            row += [
                f"{layer['relative_error']:.3f} ({layer['worst_head_error']:.3f})",
                f"{layer['topk_mass']:.3f}",
            ]
        rows.append(row)
    suggested = "; ".join(f"{r['config']['mode']}: {r['suggested_layers'] or 'none'}" for r in results)
    caption = (
        f"{results[0]['sequences']} sequences, {results[0]['tokens']:,} tokens, "
        f"C = {results[0]['config']['clusters']}; "
        f"suggested `layers=` at a budget of {results[0]['max_error']} per layer: {suggested}."
    )
    return table_lines(header, "r" * len(header), rows) + ["", caption]


def tune_table(results: list[dict]) -> list[str]:
    (result,) = results
    (metric,) = result["metrics"]
    chosen = result["chosen"]
    rows = [
        [
            "",
            f"unmodified: {metric['display']} {result['unmodified']['scores'][metric['name']]:.2f}",
            "-",
            "0.00",
            "1.00×",
            "1.00",
            "reference",
        ]
    ]
    for number, candidate in enumerate(result["candidates"], start=1):
        verdict = candidate["status"] + (" ← chosen" if number - 1 == chosen else "")
        rows.append(
            [
                str(number),
                candidate["label"],
                candidate["stage"],
                signed(candidate["changes"][metric["name"]]),
                times(candidate["speedup"]),
                f"{candidate['cost']:.2f}",
                verdict,
            ]
        )
    header = ["#", "candidate", "stage", f"Δ {metric['display']}", "speedup", "cost", "verdict"]
    caption = (
        f"{result['examples']} examples (mean length {result['mean_length']:.0f} tokens), "
        f"budget {result['budget']} points, cost `{result['cost']}`."
    )
    return table_lines(header, "rllrrrl", rows) + ["", caption]


if __name__ == "__main__":
    main()
