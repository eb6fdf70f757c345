"""Render every table of the README and docs/ from the results files that measured it.

A table lives in a document between two markers::

    <!-- table: speed-zen5 -->
    ...generated Markdown...
    <!-- /table -->

`TABLES` says, for each name, which results files (under docs/results/) it is made from, the command that
made them, which documents show it, and the function that renders it. `python scripts/render_results.py`
rewrites every marked region; `--check` rewrites nothing and exits 1, listing the stale regions, when a
committed table differs from its rendering (tests/test_render_results.py runs it), so a figure cannot
drift from its measurement. docs/results/README.md's index of the kept files is rendered the same way.

docs/benchmarks.md holds one current table set per CPU kind (`CPU_KINDS`), each headed by a rendered
table of the machine its files recorded; the README's `summary-cpus` has one row per kind, from the same
files. A table whose runs a later run of the same CPU kind replaced is *superseded*: it leaves the pages,
its figures are quoted in CHANGELOG.md (which `--check` requires to name each of its files), and its files
stay in the index, marked so, and must still render.

Usage::

    python scripts/render_results.py            # rewrite the tables
    python scripts/render_results.py --check    # exit 1 if a table is stale, naming it
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "docs/results"
MARKER = re.compile(r"<!-- table: (?P<name>[a-z0-9-]+) -->\n(?P<body>.*?)<!-- /table -->", re.DOTALL)

#: The method names of scripts/bench_attention.py and their column headings.
METHODS = {
    "kernel-i-clustered": "i-clustered",
    "kernel-i-clustered+": "i-clustered+",
    "kernel-clustered": "clustered",
}
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Table:
    """One rendered table: its results files, the command that made them, and where it is shown."""

    name: str
    sources: tuple[str, ...]  # paths under docs/results/
    documents: tuple[str, ...]  # paths from the repository root
    command: str
    render: Callable[[list[dict]], list[str]]  # the loaded sources, in order -> Markdown lines
    #: The current table that replaced this one ("" while current): shown nowhere, quoted in CHANGELOG.md.
    superseded_by: str = ""


# ---------------------------------------------------------------------------------------------------------
# Formatting


def ms(value: float) -> str:
    """A time in milliseconds at about three significant digits."""
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def times(value: float) -> str:
    """A speed ratio: two decimals below 10, one above."""
    return f"{value:.2f}×" if value < 10 else f"{value:.1f}×"


def signed(value: float) -> str:
    return f"{value:+.2f}"


def tokens(n: int) -> str:
    return f"{n:,}"


def mean_std(values: Sequence[float]) -> str:
    """Mean ± sample std of a change in points (the std only with two or more values)."""
    if len(values) < 2:
        return signed(values[0])
    return f"{signed(statistics.mean(values))} ± {statistics.stdev(values):.2f}"


def table(header: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table; align holds 'l' or 'r' per column."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def runs(count: int) -> str:
    return "one run" if count == 1 else f"{count} runs"


def joined(values: Sequence[str]) -> str:
    return " / ".join(values)


# ---------------------------------------------------------------------------------------------------------
# scripts/bench_attention.py


def attention_row(result: dict, n: int, method: str) -> dict | None:
    return next((r for r in result["rows"] if r["n"] == n and r["method"] == method), None)


def machine_line(result: dict) -> str:
    """CPU, kernel library (ISA) and torch's own CPU capability, as the run recorded them."""
    processor = result["machine"].get("processor", "?")
    isa = result["kernels"].get("kernels_cpu_isa", "one library (before the per-ISA builds)")
    capability = result.get("torch_cpu_capability")
    parts = [processor, f"kernels {isa}"]
    if capability:
        parts.append(f"torch {capability}")
    return ", ".join(parts)


def attention_caption(results: Sequence[dict]) -> str:
    first = results[0]
    shape = first["shape"]
    rows = f"{shape['rows']} padded rows of mixed lengths" if shape["mixed_lengths"] else "1 row"
    dates = sorted({r["date"][:10] for r in results})
    return (
        f"{machine_line(first)}; {first['machine']['threads']} threads; {rows}, {shape['heads']} heads × "
        f"{shape['head_dim']}; {first['timing']}; {runs(len(results))} of {', '.join(dates)}."
    )


def attention_table(methods: Sequence[str], by_dtype: bool = True, with_settings: bool = False):
    """N (and dtype) per row, SDPA's and each method's median ms per run, "a / b" over runs."""

    def render(results: list[dict]) -> list[str]:
        groups: dict[str, list[dict]] = {}
        for result in results:
            groups.setdefault(DTYPES[result["shape"]["dtype"]], []).append(result)
        header = ["N"] + (["dtype"] if by_dtype else []) + (["C, k"] if with_settings else [])
        header += ["SDPA ms"] + [f"{METHODS[m]} ms (× SDPA)" for m in methods]
        rows = []
        for dtype, runs in groups.items():
            for n in sorted({r["n"] for r in runs[0]["rows"]}):
                row = [tokens(n)] + ([dtype] if by_dtype else [])
                if with_settings:
                    clusters, topk = attention_row(runs[0], n, methods[0])["clusters_topk"]
                    row.append(f"{clusters}, {topk}")
                row.append(joined([ms(attention_row(r, n, "sdpa")["median_ms"]) for r in runs]))
                for method in methods:
                    found = [attention_row(r, n, method) for r in runs]
                    if any(f is None for f in found):
                        row.append("")
                        continue
                    row.append(
                        f"{joined([ms(f['median_ms']) for f in found])} "
                        f"({joined([times(f['speedup_vs_sdpa']) for f in found])})"
                    )
                rows.append(row)
        align = ["r"] + (["l"] if by_dtype else []) + (["r"] if with_settings else [])
        align += ["r"] * (1 + len(methods))
        return table(header, align, rows) + ["", attention_caption(results)]

    return render


def cost_table(results: list[dict]) -> list[str]:
    """i-clustered+ against i-clustered, back to back (bench_attention's cost_vs_i_clustered)."""
    (result,) = results
    rows = []
    for n in sorted({r["n"] for r in result["rows"]}):
        sdpa, plain, plus = (
            attention_row(result, n, m) for m in ("sdpa", "kernel-i-clustered", "kernel-i-clustered+")
        )
        rows.append(
            [
                tokens(n),
                ms(sdpa["median_ms"]),
                ms(plain["median_ms"]),
                ms(plus["median_ms"]),
                f"**{plus['cost_vs_i_clustered']:.2f}**",
            ]
        )
    header = [
        "N",
        "SDPA ms",
        "i-clustered ms",
        "i-clustered+ ms",
        "i-clustered+ / i-clustered (target ≤ 1.2)",
    ]
    return table(header, "rrrrr", rows) + ["", attention_caption(results)]


# ---------------------------------------------------------------------------------------------------------
# scripts/bench_model.py


def model_table(results: list[dict]) -> list[str]:
    (result,) = results
    variants = [v for v in dict.fromkeys(r["variant"] for r in result["rows"]) if v != "sdpa"]
    names = {
        "auto": "**`auto`** (convert's default)",
        "i-clustered": "i-clustered, `min_length=0`",
        "clustered": "clustered, `min_length=0`",
    }
    rows = []
    for batch in sorted({r["batch"] for r in result["rows"]}):
        for n in sorted({r["tokens"] for r in result["rows"]}):
            found = {r["variant"]: r for r in result["rows"] if r["batch"] == batch and r["tokens"] == n}
            rows.append(
                [f"{batch} × {n}", ms(found["sdpa"]["median_ms"])]
                + [times(found[v]["speedup_vs_sdpa"]) for v in variants]
            )
    header = ["batch × tokens", "SDPA ms"] + [f"{names.get(v, v)} × SDPA" for v in variants]
    crossovers = sorted(set(result.get("auto_crossovers", {}).values()))
    dtype = result.get("settings", {}).get("dtype")
    model = "all-MiniLM-L6-v2" if dtype is None else f"all-MiniLM-L6-v2 in {dtype}"
    timing = result["timing"].split(";")[0]
    caption = (
        f"{model}, {result['threads']} threads, kernels {result.get('kernels_cpu_isa', '?')}, torch "
        f"{result.get('torch_cpu_capability', '?')}; {timing}; × SDPA: the ratio of the medians; `auto` "
        f"measured its crossover at {', '.join(map(str, crossovers))} tokens; {result['date'][:10]}."
    )
    return table(header, "l" + "r" * (len(header) - 1), rows) + ["", caption]


# ---------------------------------------------------------------------------------------------------------
# scripts/bench_long_context.py


def long_dtype_table(results: list[dict]) -> list[str]:
    """One model in fp32 and bf16 (timing runs): speed against the unmodified model in the same dtype, and
    the embeddings' cosine to the fp32 unmodified model's."""
    rows = []
    for result in results:
        for row in result["rows"]:
            target = f" (≥ {row['target_speedup']:.1f}×)" if "target_speedup" in row else ""
            torch_cosine = f"{row['sdpa_cosine_min']:.4f}" if "sdpa_cosine_min" in row else "1 (itself)"
            rows.append(
                [
                    row.get("dtype", "fp32"),
                    tokens(row["length"]),
                    f"{row['sdpa_s']:.2f}",
                    f"{row['patched_s']:.2f}",
                    f"**{times(row['speedup'])}**{target}",
                    f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}",
                    torch_cosine,
                ]
            )
    header = [
        "dtype",
        "tokens",
        "unmodified s/doc",
        "patched s/doc",
        "speedup (target)",
        "patched cosine to fp32 unmodified, mean / min",
        "unmodified's own, min",
    ]
    first = results[0]
    environment = first["environment"]
    settings = first["settings"]
    caption = (
        f"{', '.join(sorted({r['rows'][0]['model'] for r in results}))}, {environment['threads']} threads, "
        f"{settings['documents']} documents × {settings['repeats']} repeats per length, convert's defaults; "
        f"torch {environment['torch']}; {', '.join(sorted({r['environment']['date'][:10] for r in results}))}"
        "."
    )
    return table(header, "lrrrrrr", rows) + ["", caption]


def linears_table(results: list[dict]) -> list[str]:
    """scripts/bench_linears.py: the encoder's linear layers alone, and the speedup they leave room for."""
    rows = []
    for result in results:
        for row in result["rows"]:
            rows.append(
                [
                    row["dtype"],
                    tokens(row["length"]),
                    f"{row['gflop']:.0f}",
                    f"{row['linears_s']:.2f} ({row['gflop_per_s']:.0f} GFLOP/s)",
                    f"{row['unmodified_s']:.2f}",
                    f"**{times(row['bound'])}**",
                    times(row["speedup"]),
                    f"{row['target_speedup']:.1f}×"
                    + ("" if row["target_within_bound"] else " (out of reach)"),
                ]
            )
    header = [
        "dtype",
        "tokens",
        "linear layers' GFLOP",
        "their s/doc alone",
        "unmodified s/doc",
        "bound: speedup with attention free",
        "patched (measured)",
        "target",
    ]
    first = results[0]
    environment = first["environment"]
    caption = (
        f"{first['rows'][0]['model']}, batch 1, {environment['threads']} threads, median of "
        f"{first['settings']['repeats']} repeats; torch {environment['torch']}; "
        f"{', '.join(sorted({r['environment']['date'][:10] for r in results}))}. Unmodified and patched: "
        f"{', '.join(sorted({row['source'] for r in results for row in r['rows']}))}."
    )
    return table(header, "lrrrrrrr", rows) + ["", caption]


def long_context_table(results: list[dict]) -> list[str]:
    """Time rows from the timing runs, memory from the memory runs (results: timing files, then memory)."""
    half = len(results) // 2
    timed = {(r["model"], r["length"]): r for res in results[:half] for r in res["rows"]}
    memory = {(r["model"], r["length"]): r for res in results[half:] for r in res["rows"]}
    rows = []
    for key, row in timed.items():
        mem = memory.get(key, {})
        target = f" (≥ {row['target_speedup']:.1f}×)" if "target_speedup" in row else ""
        speedup = f"**{times(row['speedup'])}**{target}" if target else times(row["speedup"])
        tensor = f"{mem['sdpa_tensor_peak_mib']:,.1f} / {mem['patched_tensor_peak_mib']:,.1f}" if mem else ""
        resident = f"{mem['sdpa_extra_mib']:,.0f} / {mem['patched_extra_mib']:,.0f}" if mem else ""
        rows.append(
            [
                key[0],
                tokens(key[1]),
                f"{row['sdpa_s']:.2f}",
                f"{row['patched_s']:.2f}",
                speedup,
                f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}",
                tensor,
                resident,
            ]
        )
    header = [
        "model",
        "tokens",
        "SDPA s/doc",
        "patched s/doc",
        "speedup (target)",
        "cosine mean / min",
        "tensor peak MiB SDPA / patched",
        "resident MiB SDPA / patched",
    ]
    env = results[0]["environment"]
    dates = sorted({res["environment"]["date"][:10] for res in results})
    commits = sorted({res["environment"]["git"][:7] for res in results})
    caption = (
        f"{env['threads']} threads, one process per model and length, convert's defaults; "
        f"torch {env['torch']}; runs of {', '.join(dates)} (commits {', '.join(commits)})."
    )
    return table(header, "lrrrrlrr", rows) + ["", caption]


# ---------------------------------------------------------------------------------------------------------
# scripts/finetune_recovery.py

RECOVERY_METRICS = {"accuracy": "acc", "f1": "F1", "exact_match": "EM", "pearson": "Pearson"}


def recovery_table(results: list[dict]) -> list[str]:
    """Per task and metric: the checkpoint, the fine-tuning with clustered attention in the loop and the
    control (the same fine-tuning, exact attention), each scored unmodified and at each C; over seeds the
    mean ± sample std. The target: the clustered fine-tuning at the training C within ``target`` points of
    the checkpoint's unmodified score (bold where met)."""
    settings = results[0]["settings"]
    train_c, target = settings["train_clusters"], settings["target"]
    distill = settings.get("distill", 0.0)  # results files from before the option: 0
    trained = "distilled" if distill == 1 else "fine-tuned"
    columns = ["unmodified", *(f"C={c}" for c in settings["score_clusters"])]
    rows = []
    unreverted = False
    for result in results:
        for task, entry in result["tasks"].items():
            original = entry["original"]["scores"]
            seeds = list(entry["seeds"].values())
            for metric in original["unmodified"]:
                base = original["unmodified"][metric]
                label = RECOVERY_METRICS.get(metric, metric)
                row = [task, label, "checkpoint"]
                for column in columns:
                    value = original[column][metric]
                    row.append(f"{value:.2f}" + ("" if column == "unmodified" else f" ({value - base:+.2f})"))
                rows.append(row)
                for arm, name in (
                    ("clustered", f"{trained}, C = {train_c} in the loop"),
                    ("exact", f"control: {trained}, exact"),
                ):
                    done = [seed[arm] for seed in seeds if arm in seed]  # a run in parts: some arms to come
                    if not done:
                        continue
                    row = [task, label, f"{name} ({runs(len(done)).replace('run', 'seed')})"]
                    for column in columns:
                        scored = done
                        if arm == "clustered" and column == "unmodified":
                            scored = [run for run in done if "notes" in run]  # see UNREVERTED
                            if len(scored) < len(done):
                                unreverted = True
                            if not scored:
                                row.append("–")
                                continue
                        values = [run["scores"][column][metric] for run in scored]
                        mean = statistics.mean(values)
                        spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
                        cell = f"{mean:.2f}{spread} ({mean - base:+.2f})"
                        if arm == "clustered" and column == f"C={train_c}":
                            met = mean >= base - target
                            cell = f"**{cell}**" if met else f"{cell}, missed"
                        row.append(cell)
                    rows.append(row)
    header = ["task", "metric", "model", "unmodified", *(f"C = {c}" for c in settings["score_clusters"])]
    schedule = (
        f"{settings['epochs']:g} epoch" + ("s" if settings["epochs"] != 1 else "")
        if settings.get("epochs")
        else f"{settings['max_steps']} steps"
    )
    rate = settings.get("learning_rate") or "5e-4"
    per_task = ", ".join(
        f"{task} {arms[0]['steps']} steps at max length {result['settings']['max_length']}"
        for result in results
        for task, entry in result["tasks"].items()
        if (arms := [arm for seed in entry["seeds"].values() for arm in seed.values()])
    )
    # A run in parts may have run each part on another machine: name them all, and the dates.
    machines = [e for result in results for e in (result["environment"], *result.get("parts", []))]
    cpus = "; ".join(
        dict.fromkeys(f"{e['hardware']['cpu']}, {e['hardware']['torch_threads']} threads" for e in machines)
    )
    dates = sorted({e["date"][:10] for e in machines})
    seeds_asked = max(
        max(result["settings"].get("seeds", 0), *(len(entry["seeds"]) for entry in result["tasks"].values()))
        for result in results
    )
    seed_text = "seed 0" if seeds_asked == 1 else f"seeds 0-{seeds_asked - 1}"
    caption = (
        "Scores on each task's dev split (SQuAD: held-out articles 25-48), i-clustered+, hash seed 0; "
        "change against the checkpoint's unmodified score in brackets. Fine-tuning: LoRA (rank 16, every "
        f"encoder Linear) and the task head, {schedule} ({per_task}), batch {settings['batch_size']}, "
        f"learning rate {rate}, {seed_text}; target: C = {train_c} within {target:g} of the "
        f"checkpoint's unmodified score (bold: met). {cpus}; "
        f"{dates[0] if len(dates) == 1 else f'{dates[0]} to {dates[-1]}'}."
    )
    if distill > 0:
        towards = (
            "the distance to the checkpoint's own outputs alone (labels unused)"
            if distill == 1
            else f"the task loss and, at weight {distill:g}, the distance to the checkpoint's own outputs"
        )
        caption += (
            f" Loss: {towards}, the teacher the checkpoint with exact attention, KL at temperature "
            f"{settings.get('distill_temperature', 1.0):g}, no dropout in either model (`--distill`)."
        )
    if unreverted:
        caption += " " + UNREVERTED
    return table(header, "lll" + "r" * (len(header) - 3), rows) + ["", caption]


#: Why a clustered arm's unmodified cell leaves out runs (or shows –): they were scored before evaluate
#: reverted a checkpoint saved converted, so their "unmodified" score was the saved C = 10's.
UNREVERTED = (
    "Unmodified, clustered arm: only runs scored since 2026-12-05 (–: none); before, `evaluate` scored a "
    'checkpoint saved converted with its saved settings as "unmodified", so those runs\' cell was the '
    "C = 10 model's (their C = 10 and C = 25 cells are right)."
)


def long_document_verdicts(results: list[dict]) -> dict:
    """The issue's two verdicts on the seeds' mean scores (one run: its own verdicts, as the script wrote
    them): clustered at least exact at every budget, and exact's final R@1 reached in half its time."""
    if len(results) == 1:
        return results[0]["verdicts"]

    def mean_points(variant: str) -> dict[float, dict[str, float]]:
        runs_points = [r["variants"][variant]["points"] for r in results]
        budgets = sorted({p["budget"] for points in runs_points for p in points if p["budget"]})
        out = {}
        for budget in budgets:
            points = [p for r in results for p in r["variants"][variant]["points"] if p["budget"] == budget]
            if len(points) == len(results):
                out[budget] = {k: statistics.mean(p[k] for p in points) for k in ("R@1", "seconds")}
        return out

    exact, clustered = mean_points("exact"), mean_points("clustered")
    final = exact[max(exact)]
    reached = [p["seconds"] for _, p in sorted(clustered.items()) if p["R@1"] >= final["R@1"]]
    return {
        "at_least_exact_at_every_budget": all(
            clustered[b]["R@1"] >= exact[b]["R@1"] for b in exact if b in clustered
        ),
        "exact_final_R@1": final["R@1"],
        "clustered_seconds_to_exact_final": reached[0] if reached else None,
        "exact_final_seconds": final["seconds"],
        "exact_final_within_half_time": bool(reached) and reached[0] <= final["seconds"] / 2,
    }


MEAN_NOTE = " Cells: the mean of the seeds (each seed's). Steps: each seed's."


def long_document_training_table(results: list[dict]) -> list[str]:
    """scripts/long_document_training.py: held-out R@1 and MRR@10 of exact and clustered training at each
    budget of training time (one run per seed: the mean, then each seed's), and the paper's two verdicts
    (bold where met)."""
    by_budget: dict[str, dict[float, list[dict]]] = {"exact": {}, "clustered": {}}
    for result in results:
        for variant, points in by_budget.items():
            for point in result["variants"][variant]["points"]:
                points.setdefault(point["budget"], []).append(point)

    def cell(points: list[dict], key: str) -> str:
        if len(points) != len(results):
            return "-"
        values = [p[key] for p in points]
        if len(values) == 1:
            return f"{values[0]:.1f}"
        return f"{statistics.mean(values):.1f} ({joined([f'{v:.1f}' for v in values])})"

    def mean(points: list[dict], key: str) -> float | None:
        return statistics.mean(p[key] for p in points) if len(points) == len(results) else None

    rescored = any("exact_attention" in p for points in by_budget["clustered"].values() for p in points)
    rows = []
    for budget in sorted(set(by_budget["exact"]) | set(by_budget["clustered"])):
        e, c = by_budget["exact"].get(budget, []), by_budget["clustered"].get(budget, [])
        c_exact = [{**p["exact_attention"], "step": p["step"]} for p in c if "exact_attention" in p]
        ahead = budget and None not in (mean(e, "R@1"), mean(c, "R@1")) and mean(c, "R@1") >= mean(e, "R@1")
        steps = [f"{p['step']}" for p in e] + [f"{p['step']}" for p in c]
        rows.append(
            [
                "untrained" if not budget else f"{budget:,.0f}",
                cell(e, "R@1"),
                f"**{cell(c, 'R@1')}**" if ahead else cell(c, "R@1"),
                cell(e, "MRR@10"),
                cell(c, "MRR@10"),
                f"{', '.join(steps[: len(e)]) or '-'} / {', '.join(steps[len(e) :]) or '-'}",
            ]
            + ([cell(c_exact, "R@1")] if rescored else [])
        )
    header = ["training time (s)", "exact R@1", "clustered R@1", "exact MRR@10", "clustered MRR@10", "steps"]
    header += ["clustered R@1, scored exact"] if rescored else []
    result = results[0]
    settings = result["settings"]
    verdicts = long_document_verdicts(results)
    every = verdicts["at_least_exact_at_every_budget"]
    reached = verdicts["clustered_seconds_to_exact_final"]
    final_seconds = verdicts.get(
        "exact_final_seconds", max(p["seconds"] for p in result["variants"]["exact"]["points"])
    )
    half = (
        f"reached at {reached:,.0f} s of the exact run's {final_seconds:,.0f} s"
        if reached is not None
        else "not reached within the budgets"
    )
    met = "met" if verdicts["exact_final_within_half_time"] else "missed"
    chosen = ("clusters", "mode", "cluster_growth", "topk_growth")
    convert = {k: settings[k] for k in chosen if settings.get(k) is not None}
    attention = ", ".join(f"{k} {v}" for k, v in convert.items()) or "convert's defaults"
    environment = result["environment"]
    machine = environment.get("processor", "CPU not recorded")
    per_article = settings.get("questions_per_article", 1)  # runs before the option: one question
    negatives = RECIPE_NEGATIVES[settings.get("negatives", "in-batch")]
    seeds = [r["settings"]["seed"] for r in results]
    several = len(results) > 1
    seeds_text = f"seeds {', '.join(map(str, seeds))}" if several else f"seed {seeds[0]}"
    per_seed = ""
    if several:
        per_seed = (
            " Each seed's own verdicts: "
            + "; ".join(
                f"seed {r['settings']['seed']}: every budget "
                f"{'yes' if r['verdicts']['at_least_exact_at_every_budget'] else 'no'}, half "
                f"{'met' if r['verdicts']['exact_final_within_half_time'] else 'missed'}"
                for r in results
            )
            + "."
        )
    dates = sorted({r["environment"]["date"][:10] for r in results})
    caption = (
        f"MiniLM-16k proxy, contrastive training ({negatives}, batch {settings['batch_size']} articles "
        f"with {per_article} question{'s' if per_article > 1 else ''} each, "
        f"learning rate {settings['learning_rate']:g}, attention dropout "
        f"{settings.get('attention_dropout', 0.1):g}, {seeds_text}) on the questions of SQuAD "
        f"v1.1 dev articles 1-24 against their article cut at {settings['length']:,} tokens "
        f"({result['data']['train_pairs']:,} pairs); scored on articles 25-48 "
        f"({result['data']['held_out_questions']:,} questions against 24 articles), each model with the "
        f"attention it was trained with (clustered: {attention}). Both runs in one process, one after the "
        f"other, same seed and data order; training time excludes scoring."
        f"{MEAN_NOTE if several else ''}"
        f" Bold: clustered at least exact{' (means)' if several else ''}. "
        f"Clustered at least exact at every budget: **{'yes' if every else 'no'}**; the exact run's final "
        f"R@1 ({verdicts['exact_final_R@1']:.1f}) {half}, target half: **{met}**.{per_seed} {machine}, "
        f"kernels {environment.get('kernels_cpu_isa', '?')}, {environment['threads']} threads; "
        f"{' to '.join(dates) if len(dates) > 1 else dates[0]}."
    )
    if rescored:
        caption += (
            " Scored exact: the clustered run's copies scored with exact attention as well "
            "(`--score-exact-too`): what its training learned, without its approximation's cost at scoring."
        )
    return table(header, "r" * len(header), rows) + ["", caption]


def long_document_rescored_table(results: list[dict]) -> list[str]:
    """A both-variant run of scripts/long_document_training.py, then the same command's clustered run again
    with ``--score-exact-too``: its copies scored with their own attention and with exact attention, the
    difference being what the approximation costs at scoring, against the first run's exact copies."""
    first, rerun = results
    exact = {p["budget"]: p for p in first["variants"]["exact"]["points"]}
    clustered = {p["budget"]: p for p in rerun["variants"]["clustered"]["points"]}
    earlier = {p["budget"]: p for p in first["variants"]["clustered"]["points"]}
    rows = []
    for budget in sorted(clustered):
        c, e = clustered[budget], exact.get(budget)
        rescored = c["exact_attention"]["R@1"]
        rows.append(
            [
                "untrained" if not budget else f"{budget:,.0f}",
                f"{e['R@1']:.2f} ({e['step']})" if e else "-",
                f"{c['R@1']:.2f} ({c['step']})",
                f"{rescored:.2f}",
                f"{rescored - c['R@1']:+.2f}",
                f"{rescored - e['R@1']:+.2f}" if e else "-",
            ]
        )
    same = all(
        budget in earlier and (earlier[budget]["step"], earlier[budget]["R@1"]) == (p["step"], p["R@1"])
        for budget, p in clustered.items()
    )
    header = [
        "training time (s)",
        "exact run R@1 (step)",
        "clustered run R@1 (step)",
        "clustered, scored exact",
        "approximation's cost at scoring",
        "clustered scored exact - exact run",
    ]
    environment = rerun["environment"]
    seed, questions = rerun["settings"]["seed"], rerun["data"]["held_out_questions"]
    processor = environment.get("processor", "CPU not recorded")
    caption = (
        f"The clustered run of the table above again (seed {seed}, the same command with "
        f"`--variants clustered --score-exact-too`), its copies scored with their own attention and with "
        f"exact attention (R@1 x 100, {questions:,} held-out questions: 0.02 is one question). The "
        "approximation's cost at scoring: scored exact minus scored clustered. Exact run: the table "
        "above's. The rerun's steps and R@1 at every budget equal the first run's: "
        f"**{'yes' if same else 'no'}**. {processor}, kernels {environment.get('kernels_cpu_isa', '?')}, "
        f"{environment['threads']} threads; {environment['date'][:10]}."
    )
    return table(header, "r" * len(header), rows) + ["", caption]


def long_document_fidelity_table(results: list[dict]) -> list[str]:
    """scripts/long_document_fidelity.py: the untrained proxy's R@1 per convert setting on both splits of the
    long-document training, against exact, with the cost of one training article."""
    result = results[0]
    exact = result["rows"][0]
    rows = []
    for row in result["rows"]:
        seconds = row["forward_backward_seconds"]
        cells = ["exact" if row["setting"] == "exact" else f"`{row['setting']}`"]
        cells.append("-" if row["setting"] == "exact" else f"{row['clusters']} / {row['topk']}")
        for split in ("training", "held_out"):
            change = row[split]["R@1"] - exact[split]["R@1"]
            cells += [f"{row[split]['R@1']:.2f}", "" if row is exact else f"{change:+.2f}"]
        flips = "-" if row is exact else f"+{row['held_out']['gained']} / -{row['held_out']['lost']}"
        cells += [flips, f"{row['held_out']['cosine_to_exact']:.4f}", f"{seconds:.2f}"]
        cells.append(times(exact["forward_backward_seconds"] / seconds))
        rows.append(cells)
    header = [
        "setting",
        "C / k",
        "R@1 training split",
        "vs exact",
        "R@1 held out",
        "vs exact",
        "held-out questions gained / lost",
        "cosine to exact",
        "s per article (fwd + bwd)",
        "faster than exact",
    ]
    settings, environment, data = result["settings"], result["environment"], result["data"]
    unchanged = all(row[s]["questions_exact"] for row in result["rows"] for s in ("training", "held_out"))
    caption = (
        f"The untrained MiniLM-16k proxy, articles cut at {settings['length']:,} tokens: each split's "
        f"questions ({data['training']['questions']:,} of articles 1-24, {data['held_out']['questions']:,} "
        "of articles 25-48) against its 24 articles, R@1 x 100 (one held-out question: 0.02 points). "
        "Settings: convert's defaults with the changes named (C / k: the clusters and exact keys of a "
        f"{settings['length']:,}-token row). Questions embedded once, with exact attention (convert's "
        "min_length auto keeps rows that short exact; the first 64 questions of each setting equal the "
        f"unmodified ones: **{'yes' if unchanged else 'no'}**). Gained / lost: held-out questions the "
        "setting ranks right and exact does not, and the other way. Cosine: held-out article embeddings "
        "against exact's, mean. Seconds: one training article's forward and backward. "
        f"{environment.get('processor', 'CPU not recorded')}, kernels "
        f"{environment.get('kernels_cpu_isa', '?')}, {environment['threads']} threads; "
        f"{environment['date'][:10]}."
    )
    return table(header, "lr" + "r" * (len(header) - 2), rows) + ["", caption]


#: What a question is scored against in scripts/long_document_training.py's loss (--negatives).
RECIPE_NEGATIVES = {
    "in-batch": "in-batch negatives",
    "bank": "in-batch negatives and the other training articles' last embeddings",
}


def long_document_recipes_table(results: list[dict]) -> list[str]:
    """scripts/long_document_training.py's short exact runs, one per training recipe: does the held-out R@1
    move at all with training? (The claim can only show where training improves the model.)"""
    rows = []
    budgets: list[float] = []
    for result in results:
        settings = result["settings"]
        run = result["variants"]["exact"]
        points = {p["budget"]: p for p in run["points"]}
        budgets = sorted(b for b in points if b)
        curve = [c["loss"] for c in run["curve"]]
        per_article = settings.get("questions_per_article", 1)
        negatives = settings.get("negatives", "in-batch")
        others = settings["batch_size"] - 1
        if negatives == "bank":
            others = TRAIN_ARTICLES_24 - 1
        rows.append(
            [
                f"{per_article} / {negatives}",
                f"{settings['batch_size'] * per_article}",
                f"{others}",
                f"{settings['learning_rate']:g}",
                *(f"{points[b]['R@1']:.1f}" for b in [0, *budgets]),
                str(points[budgets[-1]]["step"]),
                f"{sum(curve[:10]) / 10:.3f} / {sum(curve[-10:]) / 10:.3f}",
            ]
        )
    header = ["questions per article / negatives", "questions per step", "negatives per question", "lr"]
    header += ["R@1 untrained", *(f"R@1 at {b:,.0f} s" for b in budgets)]
    header += ["steps", "loss (first / last 10 steps)"]
    first = results[0]
    environment = first["environment"]
    caption = (
        f"Exact attention only: the MiniLM-16k proxy trained contrastively on the questions of SQuAD v1.1 "
        f"dev articles 1-24 against their article cut at {first['settings']['length']:,} tokens, batch "
        f"{first['settings']['batch_size']} articles, seed {first['settings']['seed']}; held-out R@1 on "
        f"every {first['settings']['eval_every']}th question of articles 25-48 "
        f"({first['data']['held_out_questions']:,} questions against 24 articles). "
        f"{environment.get('processor', 'CPU not recorded')}, {environment['threads']} threads; "
        f"{environment['date'][:10]}."
    )
    return table(header, "lrrr" + "r" * (len(budgets) + 1) + "rr", rows) + ["", caption]


#: The training articles of scripts/long_document_training.py (SQuAD v1.1 dev articles 1-24).
TRAIN_ARTICLES_24 = 24


#: Clustered steps from which the clustered run had passed exact on every Xeon seed (docs/finetune.md).
CLAIM_STEPS = 60


def long_document_claim_table(results: list[dict]) -> list[str]:
    """Every seed-run of scripts/long_document_training.py read together: each budget's clustered minus exact
    held-out R@1, split at CLAIM_STEPS clustered steps, and how many runs meet each of the two verdicts."""
    groups: dict[str, list[float]] = {f"< {CLAIM_STEPS}": [], f"≥ {CLAIM_STEPS}": []}
    for result in results:
        exact = {p["budget"]: p for p in result["variants"]["exact"]["points"]}
        for point in result["variants"]["clustered"]["points"]:
            if not point["budget"]:
                continue
            group = f"≥ {CLAIM_STEPS}" if point["step"] >= CLAIM_STEPS else f"< {CLAIM_STEPS}"
            groups[group].append(point["R@1"] - exact[point["budget"]]["R@1"])
    groups["all"] = [d for name in list(groups) for d in groups[name]]
    rows = [
        [
            name,
            str(len(diffs)),
            str(sum(d >= 0 for d in diffs)),
            f"{statistics.mean(diffs):+.2f}",
            f"{min(diffs):+.2f}",
            f"{max(diffs):+.2f}",
        ]
        for name, diffs in groups.items()
    ]
    header = ["clustered steps at the budget", "comparisons", "clustered at least exact", "mean difference"]
    header += ["lowest", "highest"]
    verdicts = [r["verdicts"] for r in results]
    every = sum(v["at_least_exact_at_every_budget"] for v in verdicts)
    half = sum(v["exact_final_within_half_time"] for v in verdicts)
    both = sum(v["at_least_exact_at_every_budget"] and v["exact_final_within_half_time"] for v in verdicts)
    kinds = sorted({r["environment"].get("processor", "CPU not recorded") for r in results})
    lengths = sorted({r["settings"]["length"] for r in results})
    caption = (
        f"Every seed-run of the tables above ({len(results)} runs at {', '.join(f'{n:,}' for n in lengths)} "
        f"tokens, 16 questions per article; {' and '.join(kinds)}): at each budget, the clustered run's "
        f"held-out R@1 minus the exact run's (x 100, 4,874 questions: 0.02 is one question), grouped by the "
        f"clustered run's steps at that budget. Runs meeting the target's verdicts on their own: at least "
        f"exact at every budget {every} of {len(results)}, exact's final in half the time {half} of "
        f"{len(results)}, both {both} of {len(results)}."
    )
    return table(header, "lrrrrr", rows) + ["", caption]


# ---------------------------------------------------------------------------------------------------------
# scripts/bench_training.py


def verdict(value: float, target: float, met: bool) -> str:
    """A measured ratio against its target: bold where it is met, "missed" where not."""
    shown = f"**{times(value)}**" if met else times(value)
    return f"{shown} (≥ {target:g}×{'' if met else ', missed'})"


def training_call_table(results: list[dict]) -> list[str]:
    """One attention call's forward + backward against SDPA's, with the recording forward's overhead."""
    (result,) = results
    attention = result["attention"]
    kernels = ("kernel-i-clustered", "kernel-i-clustered+")
    without = [r for r in attention["rows"] if not r.get("dropout")]
    found = {(r["dtype"], r["n"], r["method"]): r for r in without}
    rows = []
    for dtype, n in dict.fromkeys((r["dtype"], r["n"]) for r in without):
        sdpa = found[(dtype, n, "sdpa")]
        row = [tokens(n), dtype, f"{ms(sdpa['forward_ms'])} + {ms(sdpa['backward_ms'])}"]
        for method in kernels:
            r = found[(dtype, n, method)]
            ratio = r["speedup_vs_sdpa"]
            shown = (
                verdict(ratio, r["target_speedup"], r["target_met"])
                if "target_speedup" in r
                else times(ratio)
            )
            row.append(f"{ms(r['forward_ms'])} + {ms(r['backward_ms'])}: {shown}")
        row.append(joined([f"{found[(dtype, n, m)]['record_over_infer']:.2f}" for m in kernels]))
        peaks = [found[(dtype, n, m)]["peak_mib"] for m in ("sdpa", *kernels)]
        row.append("" if None in peaks else joined([f"{p:,.0f}" for p in peaks]))
        rows.append(row)
    header = [
        "N",
        "dtype",
        "SDPA fwd + bwd ms",
        "i-clustered fwd + bwd ms: × SDPA",
        "i-clustered+ fwd + bwd ms: × SDPA",
        f"recording / inference forward (≤ {result['targets']['record_over_infer_at_most']}×)",
        "peak MiB SDPA / i-c / i-c+",
    ]
    shape, settings = attention["shape"], attention["settings"]
    load = result["machine"]
    caption = (
        f"{machine_line(result)}; {load['threads']} threads; 1 × {shape['heads']} × N × {shape['head_dim']}, "
        f"C = {settings['clusters']}, k = {settings['topk']}, min_length 0; {attention['timing']}; "
        f"load average {load['load_average_before'][0]:.1f} before, "
        f"{load['load_average_after_attention'][0]:.1f} after (a shared machine); {result['date'][:10]}."
    )
    return table(header, "rlrrrrr", rows) + ["", caption]


def training_dropout_table(results: list[dict]) -> list[str]:
    """One call's forward + backward with attention dropout against the same call without, and against
    SDPA with the same dropout, from the same rounds (bench_training.py --dropout 0 P)."""
    (result,) = results
    attention = result["attention"]
    found = {(r["dtype"], r["n"], r.get("dropout", 0.0), r["method"]): r for r in attention["rows"]}
    (dropout,) = [p for p in attention["dropouts"] if p]
    rows = []
    for dtype, n, method in dict.fromkeys((r["dtype"], r["n"], r["method"]) for r in attention["rows"]):
        plain, dropped = found[(dtype, n, 0.0, method)], found[(dtype, n, dropout, method)]
        peaks = [plain["peak_mib"], dropped["peak_mib"]]
        rows.append(
            [
                tokens(n),
                dtype,
                {"sdpa": "SDPA", **METHODS}.get(method, method),
                ms(plain["forward_backward_ms"]),
                ms(dropped["forward_backward_ms"]),
                f"{dropped['over_no_dropout']:.2f}",
                "" if method == "sdpa" else times(dropped["speedup_vs_sdpa"]),
                "" if None in peaks else joined([f"{p:,.0f}" for p in peaks]),
            ]
        )
    header = [
        "N",
        "dtype",
        "method",
        "fwd + bwd ms, no dropout",
        f"fwd + bwd ms, dropout {dropout:g}",
        "with / without",
        f"× SDPA, both dropout {dropout:g}",
        "peak MiB without / with",
    ]
    shape, settings = attention["shape"], attention["settings"]
    load = result["machine"]
    caption = (
        f"{machine_line(result)}; {load['threads']} threads; 1 × {shape['heads']} × N × {shape['head_dim']}, "
        f"C = {settings['clusters']}, k = {settings['topk']}, min_length 0; {attention['timing']}, both "
        f'dropouts in the same rounds ("with / without": the median of the per-round ratios); SDPA with '
        f"dropout runs torch's N × N math path; load average {load['load_average_before'][0]:.1f} before, "
        f"{load['load_average_after_attention'][0]:.1f} after; {result['date'][:10]}."
    )
    return table(header, "rllrrrrr", rows) + ["", caption]


def training_step_table(results: list[dict]) -> list[str]:
    """A whole training step, converted against unmodified, and the bound of a free attention."""
    (result,) = results
    step = result["step"]
    rows = []
    for r in step["rows"]:
        speedup = (
            verdict(r["speedup"], r["target_speedup"], r["speedup_met"])
            if "target_speedup" in r
            else times(r["speedup"])
        )
        memory = ""
        if "sdpa_extra_mib" in r and "patched_extra_mib" in r:
            memory = f"{r['sdpa_extra_mib']:,.0f} / {r['patched_extra_mib']:,.0f}"
            memory += "" if r["memory_met"] else " (higher)"
        rows.append(
            [
                tokens(r["length"]),
                f"{r['sdpa_s']:.2f}",
                f"{r['patched_s']:.2f}",
                speedup,
                f"{r['free_s']:.2f}",
                times(r["bound"]),
                f"{r['sdpa_attention_s']:.2f} / {r['patched_attention_s']:.2f}",
                memory,
            ]
        )
    header = [
        "tokens",
        "unmodified s/step",
        "converted s/step",
        "speedup (target)",
        "attention free s/step",
        "bound: unmodified / free",
        "attention s/step unmodified / converted",
        "peak MiB unmodified / converted",
    ]
    machine = result["machine"]
    load = f"{machine['load_average_before'][0]:.1f} before, {machine['load_average_after'][0]:.1f} after"
    caption = (
        f"{step['model']}, {step['head']}, batch 1, {step['dtype']}, train mode, attention dropout "
        f"{step['attention_dropout']}, {step['optimiser']}, convert's {step['convert']}; {step['timing']}; "
        f"attention = the step less the attention-free step; {machine_line(result)}, "
        f"{machine['threads']} threads, load average {load}; {result['date'][:10]}."
    )
    return table(header, "rrrrrrrr", rows) + ["", caption]


# ---------------------------------------------------------------------------------------------------------
# scripts/bench_peers.py (bert-cluster against ONNX Runtime, OpenVINO and torch, whole model)

PEER_METHODS = ("torch", "onnx", "openvino", "bert-cluster", "bert-cluster-bf16")


#: OpenVINO's precision in a peers file that does not record it: bench_peers.py set INFERENCE_PRECISION_HINT
#: to f32 before --openvino-precision existed (and still does by default).
OPENVINO_PRECISION_BEFORE_THE_OPTION = "f32"


def openvino_precision(report: dict) -> str:
    return report.get("openvino_precision", OPENVINO_PRECISION_BEFORE_THE_OPTION)


def peers_table(results: list[dict]) -> list[str]:
    """Documents/s per method (failed cells say so), bert-cluster over the fastest peer, cosines, memory."""
    report = results[0]
    precision = openvino_precision(report)
    rows = []
    for model, lengths in report["results"].items():
        for length, cells in lengths.items():
            ratio = report["ratios"].get(model, {}).get("bert-cluster", {}).get(length, {})
            speeds = [
                f"{cells[m]['docs_per_s']:.3g}"
                if cells.get(m, {}).get("docs_per_s")
                else ("failed" if m in cells else "–")
                for m in PEER_METHODS
            ]
            cosines = [
                f"{cells[m]['cosine_min']:.3f}" if "cosine_min" in cells.get(m, {}) else "–"
                for m in PEER_METHODS[3:]
            ]
            peaks = [
                f"{cells[m]['forward_extra_mib']:,.0f}" if cells.get(m, {}).get("docs_per_s") else "–"
                for m in PEER_METHODS
            ]
            fastest = (
                f"{times(ratio['vs_fastest'])} ({ratio['fastest_peer']})" if "vs_fastest" in ratio else "–"
            )
            rows.append([model, tokens(int(length)), *speeds, fastest, joined(cosines), joined(peaks)])
    header = [
        "model",
        "tokens",
        *(f"openvino ({precision})" if m == "openvino" else m for m in PEER_METHODS),
        "bert-cluster vs fastest peer",
        "min cosine (fp32 / bf16)",
        "forward's peak MiB (same order)",
    ]
    versions = report["versions"].get("peers", {})
    loads = report["load_average_before"], report["load_average_after"]
    caption = (
        f"Documents/s, batch 1, {report['threads']} threads, {report['documents']} documents × "
        f"{report['repeats']} repeats (median), one capped process per cell; {report['machine']['cpu']}, "
        "load average (1 min) "
        f"{loads[0][0]:.1f} before, {loads[1][0]:.1f} after; ONNX Runtime {versions.get('onnxruntime', '?')} "
        f"(level {report['onnx_level']}), OpenVINO {versions.get('openvino', '?')} "
        f"({PRECISION_NOTES[precision]}); run of {report['machine']['date'][:10]}."
    )
    return table(header, "lr" + "r" * (len(header) - 2), rows) + [
        "",
        caption + PEERS_CAPTION + peers_verdicts(report),
    ]


def peers_verdicts(report: dict) -> str:
    """Where bert-cluster (fp32) overtakes each peer on the proxy, and issue 26's targets, as measured."""
    found = report.get("crossovers", {}).get("minilm-l6-16k", {}).get("bert-cluster", {})
    parts = [
        f"{peer} at {tokens(c['length'])} tokens" if c.get("length") else f"{peer}: {c['note']}"
        for peer, c in found.items()
    ]
    targets = [
        f"≥ {t['speedup_target']:g}× at {tokens(t['length'])}: "
        + {True: "met", False: "missed", None: "not measured"}[t["met"]]
        for t in report.get("targets", [])
    ]
    text = ""
    if parts:
        text += f" bert-cluster (fp32) overtakes on minilm-l6-16k: {'; '.join(parts)}."
    if targets:
        text += f" Issue 26's targets (the fastest peer, cosine ≥ 0.98): {'; '.join(targets)}."
    return text


PRECISION_NOTES = {
    "f32": "f32: INFERENCE_PRECISION_HINT=f32, the exact path",
    "default": "default: the CPU plugin's own precision, bf16 where the CPU has bf16 instructions",
}
PEERS_CAPTION = (
    " Forward's peak: the resident set one forward adds (VmHWM reset before it); a failed cell's error,"
    " and each process's own peak, are in the results file."
)


# ---------------------------------------------------------------------------------------------------------
# scripts/fidelity_runs.py (SQuAD, whole held-out half)


def lloyd_rounds(clusters: int) -> int:
    """i-clustered+'s rounds at C since 0.2: ceil(25 / C), at most 3 (attention.plus_lloyd_rounds)."""
    return min(3, -(-25 // clusters))


def squad_rows(specs: Sequence[tuple[int, str, int, int | None, int | None]]):
    """specs: (source index, mode, C, the runs' recorded lloyd_rounds or None, the rounds they ran)."""

    def render(results: list[dict]) -> list[str]:
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
            default = mode == "i-clustered+" and rounds == lloyd_rounds(clusters)
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
        return table(header, "lrrlrrrr", rows) + ["", caption]

    return render


# ---------------------------------------------------------------------------------------------------------
# bert-cluster evaluate (results.json)


def task_runs(result: dict, task: str) -> list[dict]:
    return next(t for t in result["tasks"] if t["task"] == task)["runs"]


def metric_names(result: dict, task: str) -> list[tuple[str, str]]:
    entry = next(t for t in result["tasks"] if t["task"] == task)
    return [(m["name"], m["display"]) for m in entry["metrics"]]


def evaluate_columns(
    tasks: Sequence[str], columns: Sequence[tuple[str, int, str, int]], skip: Sequence[tuple[int, str]] = ()
):
    """Unmodified and one column per (heading, source index, mode, C), one seed; the change in brackets.

    skip: (source index, task) pairs whose runs are superseded by another column's.
    """

    def shown(results: list[dict], index: int, task: str) -> bool:
        return (index, task) not in skip and any(t["task"] == task for t in results[index]["tasks"])

    def render(results: list[dict]) -> list[str]:
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
        return table(header, "llr" + "r" * len(columns), rows) + ["", caption]

    return render


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
    return table(header, "llr" + "r" * len(settings), rows) + ["", caption]


# ---------------------------------------------------------------------------------------------------------
# Other scripts' JSON


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
    return table(["setting", "R@1", "R@5", "MRR@10", "R@1 change"], "lrrrr", rows) + ["", caption]


#: bench_length_scaling.py's setting names when those runs were made ("default" was 0.1's).
LENGTH_SETTINGS = {
    "default": "i-clustered, growth 0.75 / 0.5 (0.1's default)",
    "i-clustered+": "i-clustered+ at 0.1's C and k",
    "i-clustered+ cg=0.5": "**i-clustered+, growth 0.5 / 0.5 (0.2's default)**",
    "i-clustered+ cg=0.25": "i-clustered+, growth 0.25 / 0.5",
    "i-clustered+ cg=0.5 kg=0.25": "i-clustered+, growth 0.5 / 0.25",
}


def length_scaling_table(results: list[dict]) -> list[str]:
    rows = []
    for result in results:
        for row in result["rows"]:
            if row["setting"] == "sdpa":
                continue
            rows.append(
                [
                    tokens(row["tokens"]),
                    LENGTH_SETTINGS.get(row["setting"], row["setting"]),
                    str(row["clusters"]),
                    str(row["topk"]),
                    f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}",
                    times(row["speedup_median_of_ratios"]),
                ]
            )
    caption = f"{results[0]['threads']} thread(s); {results[0]['timing']}; {results[0]['date'][:10]}."
    return table(["N", "setting", "C", "k", "cosine mean / min", "× SDPA"], "llrrlr", rows) + ["", caption]


def screen_table(results: list[dict]) -> list[str]:
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
    return table(header, "l" + "r" * (len(header) - 1), rows) + ["", caption]


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
    return table(header, "r" * len(header), rows) + ["", caption]


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
    return table(header, "rllrrrl", rows) + ["", caption]


# ---------------------------------------------------------------------------------------------------------
# The registry


def embed_memory_table(data: list[dict]) -> list[str]:
    """embed's peak resident memory and throughput against the corpus size (scripts/bench_embed_memory.py)."""
    rows = []
    for result in data:
        for run in result["runs"]:
            name = "streaming" if run["implementation"] == "current" else "whole corpus (0.2.0)"
            rows.append(
                [
                    f"{run['documents']:,}",
                    name,
                    f"{run['peak_rss_mib']:,.0f}",
                    f"{run['documents_per_second']:,.0f}",
                ]
            )
    lines = table(["documents", "implementation", "peak resident MiB", "documents/s (wall)"], "rlrr", rows)
    first, summary = data[0], data[0]["summary"]
    settings, environment = first["settings"], first["environment"]
    lines += [
        "",
        f"{settings['model']}; shards of {settings['shard_size']:,}, {settings['threads']} threads; "
        f"the largest corpus's peak is {summary['largest_over_smallest_peak']:.3f}x the smallest's "
        f"(targets: below {summary['targets']['peak_mib_below']:,} MiB and "
        f"{summary['targets']['ratio_below']}x); the process holds "
        f"{first['runs'][0]['rss_before_embed_mib']:,.0f} MiB before the run; AMD EPYC (Zen 4), "
        f"{environment['date'][:10]}. The machine was shared (load average 4-16): the rates are its load's; "
        "the 50,000-document pair ran back to back.",
    ]
    return lines


def boundary_table(data: list[dict]) -> list[str]:
    """The attention function transformers calls against the op (scripts/bench_boundary.py)."""
    runs_ = data[0]["runs"]
    rows = [
        [
            str(run["threads"]),
            str(run["pair"]),
            run["kernels"],
            ms(run["median_ms"]["op"]),
            ms(run["median_ms"]["function"]),
            f"{run['function_over_op']:.3f}",
        ]
        for run in sorted(runs_, key=lambda r: (r["threads"], r["pair"]))
    ]
    lines = table(["threads", "pair", "code", "op ms", "function ms", "function / op"], "rrlrrr", rows)
    first = runs_[0]
    lines += [
        "",
        f"1 x 12 x {first['length']:,} x 64, {first['mode']}, C = 25, k = 32, median of {first['rounds']} "
        f"interleaved rounds, torch {first['torch']}. {data[0]['note']}",
    ]
    return lines


# ---------------------------------------------------------------------------------------------------------
# One section per CPU kind: its machine, and the README's one row per kind


@dataclass(frozen=True)
class CpuKind:
    """A CPU kind of docs/benchmarks.md: its name, and its current tables by part (None: not measured)."""

    key: str  # the section's table, ``cpu-KEY``
    name: str  # model and ISA, as the section's heading says them
    attention: str | None = None  # bench_attention.py, one call, 1 row, C = 25, k = 32 (fp32 runs used)
    long: str | None = None  # bench_long_context.py (timing files first)
    peers: str | None = None  # bench_peers.py
    training: str | None = None  # bench_training.py --parts step
    others: tuple[str, ...] = ()  # its other current tables (machine table only)

    def parts(self) -> dict[str, str]:
        named = {"attention": self.attention, "long": self.long, "peers": self.peers}
        named["training"] = self.training
        return {part: name for part, name in named.items() if name}

    def tables(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.parts().values(), *self.others)))


def recorded(result: dict) -> dict:
    """What a results file says about its machine, whichever script wrote it (None where it does not)."""
    machine, environment = result.get("machine", {}), result.get("environment", {})
    hardware = environment.get("hardware", {})
    kernels = result.get("kernels", {})
    return {
        "date": (result.get("date") or environment.get("date") or machine.get("date") or "")[:10] or None,
        "cpu": machine.get("processor") or machine.get("cpu") or hardware.get("cpu"),
        "kernels": kernels.get("kernels_cpu_isa") or result.get("kernels_cpu_isa"),
        "torch": result.get("torch_cpu_capability"),
        "threads": machine.get("threads")
        or result.get("threads")
        or environment.get("threads")
        or distinct([r.get("threads") for r in result.get("runs", []) if isinstance(r, dict)], None),
        "cores": machine.get("cpu_count") or environment.get("cpu_count"),
    }


def distinct(values: Sequence, missing: str | None = "not recorded") -> str | None:
    """The values' distinct texts, sorted and joined; ``missing`` where there is none."""
    found = sorted({str(v) for v in values if v is not None})
    return ", ".join(found) if found else missing


def machine_table(tables: Sequence[tuple[str, int]]):
    """One row per table of a CPU kind: its files' dates, CPU, kernel library, torch's ISA, threads, cores.

    ``tables`` names each table and how many of the sources (in order) are its.
    """

    def render(results: list[dict]) -> list[str]:
        if sum(count for _, count in tables) != len(results):
            raise ValueError(f"machine_table: {len(results)} files for {tables}")
        rows, start = [], 0
        for name, count in tables:
            found = [recorded(r) for r in results[start : start + count]]
            start += count
            rows.append(
                [
                    f"`{name}`",
                    str(count),
                    distinct(f["date"] for f in found),
                    distinct(f["cpu"] for f in found),
                    f"{distinct(f['kernels'] for f in found)} / {distinct(f['torch'] for f in found)}",
                    f"{distinct(f['threads'] for f in found)} / {distinct(f['cores'] for f in found)}",
                ]
            )
        header = ["table", "files", "dates", "CPU as recorded", "kernels / torch's ISA", "threads / cores"]
        caption = (
            "As each results file recorded its machine (`x86_64_v4`: the AVX-512 kernel library, "
            '`x86_64_v3`: AVX2 + FMA); "not recorded": the script did not write it then.'
        )
        return table(header, "lrllll", rows) + ["", caption]

    return render


SUMMARY_LENGTHS = {"attention": (512, 4096), "long": (8192, 16384), "peers": (8192, 16384)}
SUMMARY_LENGTHS["training"] = (4096, 16384)


def lowest_call_ratio(results: list[dict], n: int) -> float | None:
    """i-clustered's × SDPA at N in fp32, the lower over the runs."""
    found = [
        attention_row(r, n, "kernel-i-clustered")
        for r in results
        if DTYPES[r["shape"]["dtype"]] == "fp32" and not r["shape"]["mixed_lengths"]
    ]
    return min((f["speedup_vs_sdpa"] for f in found if f), default=None)


def long_ratio(results: list[dict], n: int) -> float | None:
    """The MiniLM-16k proxy's speedup over the unmodified model at n tokens in fp32 (timing runs)."""
    for result in results:
        for row in result["rows"]:
            if (
                row.get("model") == "minilm-l6-16k"
                and row["length"] == n
                and row.get("dtype", "fp32") == "fp32"
                and "speedup" in row
            ):
                return row["speedup"]
    return None


def summary_cell(part: str, results: list[dict]) -> str:
    first, second = SUMMARY_LENGTHS[part]
    if part == "attention":
        values = [lowest_call_ratio(results, n) for n in (first, second)]
        suffix = ""
    elif part == "long":
        values = [long_ratio(results, n) for n in (first, second)]
        suffix = ""
    elif part == "peers":
        (report,) = results
        ratios = report["ratios"].get("minilm-l6-16k", {}).get("bert-cluster", {})
        entries = [ratios.get(str(n), {}) for n in (first, second)]
        values = [e.get("vs_fastest") for e in entries]
        peers = joined(list(dict.fromkeys(e.get("fastest_peer", "–") for e in entries)))
        suffix = f" ({peers}; OpenVINO {openvino_precision(report)})"
    else:
        (result,) = results
        by_length = {r["length"]: r["speedup"] for r in result["step"]["rows"]}
        values = [by_length.get(n) for n in (first, second)]
        suffix = ""
    if all(v is None for v in values):
        return "–"
    return joined(["–" if v is None else times(v) for v in values]) + suffix


def summary_table(kinds: Sequence[CpuKind], counts: dict[str, int]):
    """One row per CPU kind: its current tables' headline ratios (sources: each kind's parts, in order)."""

    def render(results: list[dict]) -> list[str]:
        rows, start = [], 0
        for kind in kinds:
            row, dates = [kind.name], []
            for part in ("attention", "long", "peers", "training"):
                name = kind.parts().get(part)
                if name is None:
                    row.append("–")
                    continue
                mine = results[start : start + counts[name]]
                start += counts[name]
                row.append(summary_cell(part, mine))
                dates += [recorded(r)["date"] for r in mine]
            row.append(distinct(dates))
            rows.append(row)
        if start != len(results):
            raise ValueError(f"summary_table: {len(results)} files, {start} read")
        header = [
            "CPU",
            "one call, i-clustered × SDPA, 512 / 4,096 tokens",
            "whole model × unmodified, 8,192 / 16,384",
            "× fastest peer, 8,192 / 16,384",
            "training step × unmodified, 4,096 / 16,384",
            "dates",
        ]
        caption = (
            "fp32, 2 threads. One call: 1 row, 12 heads × 64, C = 25, k = 32, the lower of the runs; whole "
            "model and peers: the MiniLM-16k proxy, one document at a time, `convert`'s defaults; training: "
            "a step of that proxy with a classification head; –: not measured on that CPU. Each CPU's "
            "tables, commands and machine: docs/benchmarks.md."
        )
        return table(header, "lrrrrl", rows) + ["", caption]

    return render


README = "README.md"
BENCHMARKS = "docs/benchmarks.md"
FIDELITY = "docs/fidelity.md"
FINETUNE = "docs/finetune.md"
USAGE = "docs/usage.md"
EMBED = "docs/embed.md"
TRAINING = "docs/training.md"

BENCH = "python scripts/bench_attention.py --threads 2"
THREE = "--methods sdpa kernel-i-clustered kernel-i-clustered+"
SQUAD_HALF = (
    "python scripts/fidelity_runs.py /tmp/bc-models/minilm-l6-squad --task squad "
    "--data-dir ../shared/models/minilm-l6-squad/eval --runs MODE:C:SEED ... --output FILE"
)

#: The per-CPU files of the one-call speed tables (fp32 runs, then bf16).
SPEED_FILES = {
    "Zen 5": (
        "bench_attention_zen5/targets_fp32_1.json",
        "bench_attention_zen5/targets_fp32_2.json",
        "bench_attention_zen5/targets_bf16_1.json",
        "bench_attention_zen5/targets_bf16_2.json",
    ),
    "Ice Lake": ("bench_attention_icelake/targets_fp32.json", "bench_attention_icelake/targets_bf16.json"),
    "Emerald Rapids": (
        "bench_attention_emerald/targets_fp32.json",
        "bench_attention_emerald/targets_bf16.json",
    ),
    "Zen 3": (
        "bench_attention_zen3_1207/targets_fp32_1.json",
        "bench_attention_zen3_1207/targets_fp32_2.json",
        "bench_attention_zen3_1207/targets_bf16_1.json",
        "bench_attention_zen3_1207/targets_bf16_2.json",
    ),
    "Zen 3, 2026-12-03": (
        "bench_attention_zen3/targets_fp32_1.json",
        "bench_attention_zen3/targets_fp32_2.json",
        "bench_attention_zen3/targets_bf16_1.json",
        "bench_attention_zen3/targets_bf16_2.json",
    ),
    "Zen 1": (
        "bench_attention_zen1/targets_fp32_1.json",
        "bench_attention_zen1/targets_fp32_2.json",
        "bench_attention_zen1/targets_bf16_1.json",
        "bench_attention_zen1/targets_bf16_2.json",
    ),
    "Xeon with AMX": (
        "bench_attention_xeon_amx/targets_fp32_1.json",
        "bench_attention_xeon_amx/targets_fp32_2.json",
        "bench_attention_xeon_amx/targets_bf16_1.json",
        "bench_attention_xeon_amx/targets_bf16_2.json",
    ),
}

# ---------------------------------------------------------------------------------------------------------
# benchmarks/serve.py (bert-cluster serve under load, against Infinity)

SERVE_WORKLOADS = {
    "short": "short queries, 10-60 tokens",
    "long-2048": "documents, 2,048 tokens",
    "long-8192": "documents, 8,192 tokens",
    "mix": "mix: 90% short, 10% of 8,192 tokens (short requests' p99)",
}
SERVE_ARMS = ("clustered", "exact", "infinity")


def serve_table(results: list[dict]) -> list[str]:
    """Requests/s and p99 per workload, concurrency and server; issue 68's targets, met or missed."""
    report = results[0]
    cells = {(c["workload"], c["concurrency"], c["arm"]): c for c in report["cells"]}

    def p99(cell: dict, workload: str) -> float | None:
        latency = (cell.get("latency_ms_by_kind") or {}).get("short") if workload == "mix" else None
        return (latency or cell.get("latency_ms") or {}).get("p99")

    rows = []
    for workload, label in SERVE_WORKLOADS.items():
        levels = sorted({level for (name, level, _) in cells if name == workload})
        if not levels:
            continue
        found = [[cells.get((workload, level, arm), {}) for level in levels] for arm in SERVE_ARMS]
        rates = [
            joined([f"{c['requests_per_s']:.3g}" if c.get("requests_per_s") else "–" for c in arm])
            for arm in found
        ]
        ratios = joined(
            [
                times(c["requests_per_s"] / i["requests_per_s"])
                if c.get("requests_per_s") and i.get("requests_per_s")
                else "–"
                for c, i in zip(found[0], found[2], strict=True)
            ]
        )
        latencies = [
            joined([ms(p99(c, workload)) if p99(c, workload) else "–" for c in arm]) for arm in found
        ]
        rows.append([label, joined([str(level) for level in levels]), *rates, ratios, *latencies])
    header = [
        "workload",
        "concurrency",
        "req/s clustered",
        "req/s exact",
        "req/s Infinity",
        "clustered × Infinity",
        "p99 ms clustered",
        "p99 ms exact",
        "p99 ms Infinity",
    ]
    loads = report["load_average_before"], report["load_average_after"]
    caption = (
        f"The MiniLM-16k proxy, {report['threads']} torch thread(s) per server, one input per request, "
        f"{report['rounds']} round(s) per cell (arms in turn, then reversed); {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, shared: load average (1 min) {loads[0][0]:.1f} before, "
        f"{loads[1][0]:.1f} after, the run at nice {report['machine']['nice']}; bert-cluster "
        f"{report['versions']['bert-cluster']}, Infinity {report['versions']['infinity-emb']}; run of "
        f"{report['date'][:10]}. " + serve_verdicts(report["targets"])
    )
    return table(header, "ll" + "r" * (len(header) - 2), rows) + ["", caption]


def serve_verdicts(targets: dict) -> str:
    """Issue 68's targets as measured, for every arm (the control's included)."""

    def mark(met: bool | None) -> str:
        return {True: "met", False: "missed", None: "not measured"}[met]

    def ratios(target: dict, arm: str) -> str:
        found = target["arms"][arm]
        values = ", ".join(f"{r:.3g}× at {c}" for c, r in found["ratios"].items())
        return f"{arm} {mark(found['met'])} ({values})"

    long, short = targets["long_8192_vs_infinity"], targets["short_vs_infinity"]
    parts = [
        f"Targets: 8,192-token documents ≥ {long['target']:g}× Infinity's requests/s: "
        + "; ".join(ratios(long, arm) for arm in ("clustered", "exact")),
        f"short queries ≥ {short['target']:g}×: "
        + "; ".join(ratios(short, arm) for arm in ("clustered", "exact")),
    ]
    mixed = []
    for arm, found in targets["mix_short_p99"].items():
        levels = ", ".join(
            f"{ms(entry['short_p99_ms'])} {'≤' if entry['met'] else '>'} {ms(entry['bound_ms'])} ms "
            f"at {level}"
            if entry.get("met") is not None
            else f"{entry.get('note', 'not measured')} at {level}"
            for level, entry in found["levels"].items()
        )
        mixed.append(f"{arm} {mark(found['met'])} ({levels})")
    parts.append(
        "in the mix, short p99 ≤ one long batch (the arm's p50 for one 8,192-token document) "
        "+ 2 × short-only p99: " + "; ".join(mixed)
    )
    errors = targets["no_errors"]
    parts.append(
        "no error but deliberate 429s: "
        + "; ".join(
            f"{arm} {mark(e['met'])} ({e['errors']} errors, {e['deliberate_429']} 429s)"
            for arm, e in errors.items()
        )
    )
    return "; ".join(parts) + "."


MEASURED: tuple[Table, ...] = (
    Table(
        "speed-zen5",
        SPEED_FILES["Zen 5"],
        (BENCHMARKS,),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 40 --no-memory --dtype fp32|bf16 --output FILE (two runs each)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "speed-icelake",
        SPEED_FILES["Ice Lake"],
        (BENCHMARKS,),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 20 --no-memory --dtype fp32|bf16 --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "speed-emerald",
        SPEED_FILES["Emerald Rapids"],
        (BENCHMARKS,),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 20 --no-memory --dtype fp32|bf16 --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "speed-emerald-mixed",
        ("bench_attention_emerald/mixed_fp32.json", "bench_attention_emerald/mixed_bf16.json"),
        (BENCHMARKS,),
        f"{BENCH} --mixed --lengths 512 4096 {THREE} --order blocked --repeats 7 --no-memory "
        "--dtype fp32|bf16 --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "long-emerald",
        ("long_context_emerald/long_fp32.json", "long_context_emerald/long_bf16.json"),
        (BENCHMARKS,),
        "python scripts/bench_long_context.py --models minilm-l6-16k --lengths 8192 16384 --repeats 2 "
        "--documents 2 --no-memory --dtype fp32|bf16 --output FILE",
        long_dtype_table,
    ),
    Table(
        "speed-zen3",
        SPEED_FILES["Zen 3"],
        (BENCHMARKS,),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 20 --no-memory --dtype fp32|bf16 --output FILE (two runs each)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "speed-zen3-mixed",
        ("bench_attention_zen3_1207/mixed_fp32.json", "bench_attention_zen3_1207/mixed_bf16.json"),
        (BENCHMARKS,),
        f"{BENCH} --mixed --lengths 512 4096 {THREE} --order blocked --repeats 7 --no-memory "
        "--dtype fp32|bf16 --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "long-zen3",
        ("long_context_zen3_1207/long_fp32.json", "long_context_zen3_1207/long_bf16.json"),
        (BENCHMARKS,),
        "python scripts/bench_long_context.py --models minilm-l6-16k --lengths 8192 16384 --repeats 2 "
        "--documents 2 --no-memory --dtype fp32|bf16 --output FILE",
        long_dtype_table,
    ),
    Table(
        "linears-zen3",
        ("long_context_zen3_1207/linears_fp32.json", "long_context_zen3_1207/linears_bf16.json"),
        (BENCHMARKS,),
        "python scripts/bench_linears.py --dtype fp32|bf16 --long-context "
        "docs/results/long_context_zen3_1207/long_fp32.json|long_bf16.json --output FILE",
        linears_table,
    ),
    Table(
        "speed-zen3-2026-12-03",
        SPEED_FILES["Zen 3, 2026-12-03"],
        (),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 20 --no-memory --dtype fp32|bf16 --output FILE (two runs each)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
        superseded_by="speed-zen3",
    ),
    Table(
        "speed-zen3-mixed-2026-12-03",
        ("bench_attention_zen3/mixed_fp32.json", "bench_attention_zen3/mixed_bf16.json"),
        (),
        f"{BENCH} --mixed --lengths 512 4096 {THREE} --order blocked --repeats 7 --no-memory "
        "--dtype fp32|bf16 --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
        superseded_by="speed-zen3-mixed",
    ),
    Table(
        "long-zen3-2026-12-03",
        ("long_context_zen3/long_fp32.json", "long_context_zen3/long_bf16.json"),
        (),
        "python scripts/bench_long_context.py --models minilm-l6-16k --lengths 8192 16384 --repeats 2 "
        "--documents 2 --no-memory --dtype fp32|bf16 --output FILE",
        long_dtype_table,
        superseded_by="long-zen3",
    ),
    Table(
        "linears-zen3-2026-12-03",
        ("long_context_zen3/linears_fp32.json", "long_context_zen3/linears_bf16.json"),
        (),
        "python scripts/bench_linears.py --dtype fp32|bf16 --long-context "
        "docs/results/long_context_zen3/long_fp32.json|long_bf16.json --output FILE",
        linears_table,
        superseded_by="linears-zen3",
    ),
    Table(
        "speed-zen1",
        SPEED_FILES["Zen 1"],
        (BENCHMARKS,),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 20 --no-memory --dtype fp32|bf16 --output FILE (two runs each)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "long-zen1",
        ("long_context_zen1/long_fp32.json",),
        (BENCHMARKS,),
        "python scripts/bench_long_context.py --models minilm-l6-16k --lengths 8192 16384 --repeats 2 "
        "--documents 2 --no-memory --dtype fp32 --output FILE",
        long_dtype_table,
    ),
    Table(
        "linears-zen1",
        ("long_context_zen1/linears_fp32.json",),
        (BENCHMARKS,),
        "python scripts/bench_linears.py --dtype fp32 --long-context "
        "docs/results/long_context_zen1/long_fp32.json --output FILE",
        linears_table,
    ),
    Table(
        "model-emerald-bf16",
        ("bench_model_emerald_bf16.json",),
        (BENCHMARKS,),
        "python scripts/bench_model.py --threads 2 --repeats 7 --lengths 64 128 256 384 512 --batches 1 8 "
        "--variants sdpa auto i-clustered --dtype bf16 --output FILE",
        model_table,
    ),
    Table(
        "speed-zen5-mixed",
        ("bench_attention_zen5/mixed_fp32.json", "bench_attention_zen5/mixed_bf16.json"),
        (BENCHMARKS,),
        f"{BENCH} --mixed --lengths 128 512 2048 {THREE} "
        "--order blocked --repeats 7 --no-memory --dtype fp32|bf16 --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "speed-zen5-long",
        ("bench_attention_zen5/long_fp32.json",),
        (BENCHMARKS,),
        f"{BENCH} --lengths 8192 16384 32768 {THREE} --order blocked --repeats 3 --no-memory --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"], by_dtype=False),
    ),
    Table(
        "model-zen5",
        ("bench_model_zen5.json",),
        (BENCHMARKS,),
        "python scripts/bench_model.py --threads 2 --repeats 7 --lengths 64 128 256 384 512 --batches 1 8 "
        "--variants sdpa auto i-clustered --output FILE",
        model_table,
    ),
    Table(
        "speed-xeon",
        ("bench_attention_targets/overheads_final_1.json", "bench_attention_targets/overheads_final_2.json"),
        (),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 40 --no-memory --output FILE (two runs)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"], by_dtype=False),
        superseded_by="speed-xeon-amx",
    ),
    Table(
        "speed-xeon-amx",
        SPEED_FILES["Xeon with AMX"],
        (BENCHMARKS,),
        f"{BENCH} --lengths 128 512 4096 {THREE} --order blocked "
        "--repeats 40 --no-memory --dtype fp32|bf16 --output FILE (two runs each)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"]),
    ),
    Table(
        "long-xeon-amx",
        ("long_context_xeon_amx/long_fp32.json", "long_context_xeon_amx/long_bf16.json"),
        (BENCHMARKS,),
        "python scripts/bench_long_context.py --models minilm-l6-16k --lengths 8192 16384 --repeats 2 "
        "--documents 2 --no-memory --dtype fp32|bf16 --output FILE",
        long_dtype_table,
    ),
    Table(
        "linears-xeon-amx",
        ("long_context_xeon_amx/linears_fp32.json", "long_context_xeon_amx/linears_bf16.json"),
        (BENCHMARKS,),
        "python scripts/bench_linears.py --dtype fp32|bf16 --long-context "
        "docs/results/long_context_xeon_amx/long_fp32.json|long_bf16.json --output FILE",
        linears_table,
    ),
    Table(
        "model-xeon-amx-bf16",
        ("bench_attention_xeon_amx/model_bf16.json",),
        (BENCHMARKS,),
        "python scripts/bench_model.py --threads 2 --repeats 7 --lengths 64 128 256 384 512 --batches 1 8 "
        "--variants sdpa auto i-clustered --dtype bf16 --output FILE",
        model_table,
    ),
    Table(
        "speed-xeon-bf16",
        ("bench_attention_bf16.json",),
        (),
        f"{BENCH} --dtype bf16 --lengths 128 512 4096 {THREE} "
        "--order blocked --repeats 5 --no-memory --output FILE",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"], by_dtype=False),
        superseded_by="speed-xeon-amx",
    ),
    Table(
        "speed-xeon-avx2",
        ("bench_attention_avx2/short_v3_after_1.json", "bench_attention_avx2/short_v3_after_2.json"),
        (),
        "BERT_CLUSTER_CPU_ISA=x86_64_v3 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 "
        f"{BENCH} --lengths 128 512 --methods sdpa kernel-i-clustered kernel-i-clustered+ --order blocked "
        "--repeats 40 --no-memory --output FILE (two runs)",
        attention_table(["kernel-i-clustered", "kernel-i-clustered+"], by_dtype=False),
        superseded_by="speed-zen3",
    ),
    Table(
        "speed-xeon-avx2-growth",
        (
            "bench_attention_avx2/plus_growth_v3_after_1.json",
            "bench_attention_avx2/plus_growth_v3_after_2.json",
        ),
        (),
        "BERT_CLUSTER_CPU_ISA=x86_64_v3 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 "
        f"{BENCH} --growth --head-dim 32 --lengths 512 4096 8192 --methods sdpa kernel-i-clustered+ "
        "--order blocked --repeats 11 --no-memory --output FILE (two runs)",
        attention_table(["kernel-i-clustered+"], by_dtype=False, with_settings=True),
        superseded_by="speed-zen3",
    ),
    Table(
        "long-documents",
        (
            "long_context/long_minilm.json",
            "long_context/long_random_8k_time.json",
            "long_context/long_minilm_memory.json",
            "long_context/long_random_8k_memory.json",
        ),
        (BENCHMARKS,),
        "python scripts/bench_long_context.py --models minilm-l6-16k --minilm-16k OUT/minilm-l6-16k "
        "--repeats 2 --documents 2; --models modernbert-base xlmr-large-8k --lengths 8192 --repeats 1 "
        "--no-memory; "
        "the same with --no-time --memory-forwards 1 (memory)",
        long_context_table,
    ),
    Table(
        "peers-zen5",
        ("peers/bench_peers.json",),
        (BENCHMARKS,),
        "python scripts/bench_peers.py --documents 2 --repeats 2 --memory-cap-gib 10",
        peers_table,
    ),
    Table(
        "peers-icelake",
        ("peers_icelake/bench_peers.json",),
        (BENCHMARKS,),
        "python scripts/bench_peers.py --models minilm-l6-16k --lengths 8192 16384 --documents 2 --repeats 2 "
        "--memory-cap-gib 10 --output FILE",
        peers_table,
    ),
    Table(
        "peers-zen1",
        ("peers_zen1/bench_peers.json",),
        (BENCHMARKS,),
        "python scripts/bench_peers.py --models minilm-l6-16k --lengths 8192 16384 --documents 2 --repeats 2 "
        "--memory-cap-gib 10 --openvino-precision default --methods torch,onnx,openvino,bert-cluster "
        "--timeout 1200 --output FILE",
        peers_table,
    ),
    Table(
        "peers-zen3",
        ("peers_zen3/bench_peers.json",),
        (BENCHMARKS,),
        "python scripts/bench_peers.py --models minilm-l6-16k --lengths 8192 16384 --documents 2 --repeats 2 "
        "--memory-cap-gib 10 --openvino-precision default --methods torch,onnx,openvino,bert-cluster "
        "--timeout 1200 --output FILE",
        peers_table,
    ),
    Table(
        "peers-xeon-amx",
        ("peers_xeon_amx/bench_peers.json",),
        (BENCHMARKS,),
        "python scripts/bench_peers.py --models minilm-l6-16k --lengths 8192 16384 --documents 2 --repeats 2 "
        "--memory-cap-gib 10 --openvino-precision default --output FILE",
        peers_table,
    ),
    Table(
        "fidelity-squad",
        ("fidelity_squad_rounds.json", "fidelity_squad_half.json"),
        (README, FIDELITY),
        SQUAD_HALF,
        squad_rows(
            [
                (1, "i-clustered", 10, None, None),
                (1, "i-clustered+", 10, None, 3),
                (0, "i-clustered+", 25, 1, 1),
                (1, "i-clustered", 50, None, None),
                (0, "i-clustered+", 50, 1, 1),
                (0, "i-clustered+", 100, 1, 1),
            ]
        ),
    ),
    Table(
        "fidelity-rounds",
        ("fidelity_squad_rounds.json", "fidelity_squad_half.json"),
        (FIDELITY,),
        SQUAD_HALF + " (the rounds patched in)",
        squad_rows(
            [
                (0, "i-clustered+", 10, 1, 1),
                (0, "i-clustered+", 10, 2, 2),
                (1, "i-clustered+", 10, None, 3),
                (0, "i-clustered+", 25, 1, 1),
                (1, "i-clustered+", 25, None, 3),
                (1, "i-clustered+", 50, None, 3),
                (1, "i-clustered+", 100, None, 3),
            ]
        ),
    ),
    Table(
        "fidelity-glue25",
        ("fidelity_glue25/results.json", "fidelity_glue25_default/results.json"),
        (FIDELITY,),
        'bert-cluster evaluate "/tmp/bc-models/minilm-l6-{task}" --task rte,mrpc,stsb,sst2 -c 25 --mode '
        "i-clustered+ --seeds 1 --data-dir ../shared/data -o DIR (and --mode i-clustered --mode i-clustered+ "
        "on the code before 0.2's rounds rule)",
        evaluate_columns(
            ["rte", "mrpc", "stsb", "sst2"],
            [
                ("i-clustered", 0, "i-clustered", 25),
                ("**i-clustered+ (default, 1 round)**", 1, "i-clustered+", 25),
                ("i-clustered+, 3 rounds", 0, "i-clustered+", 25),
            ],
        ),
    ),
    Table(
        "demo",
        ("demo_sample/results.json",),
        (FIDELITY,),
        "bert-cluster evaluate -o DIR (the embedded default, as scripts/demo.sh runs it)",
        evaluate_columns(
            ["stsb-embedding", "squad-retrieval-sample", "squad-articles-proxy"],
            [("i-clustered+ C=25", 0, "i-clustered+", 25)],
        ),
    ),
    Table(
        "demo-full",
        ("demo_plus/results.json", "demo_plus_articles/results.json", "demo_full_results.json"),
        (FIDELITY,),
        "bert-cluster evaluate -o DIR (the embedded default before its retrieval sample, i.e. --task "
        "stsb-embedding,squad-retrieval,squad-articles-proxy; --task squad-articles-proxy for the articles "
        "again on the idle machine; --mode i-clustered for the paper's mode)",
        evaluate_columns(
            ["stsb-embedding", "squad-retrieval", "squad-articles-proxy"],
            [
                ("i-clustered+ C=25, STS-B and SQuAD", 0, "i-clustered+", 25),
                ("i-clustered+ C=25, articles (final settings, idle)", 1, "i-clustered+", 25),
                ("i-clustered C=25 (0.1's default)", 2, "i-clustered", 25),
            ],
            skip=[(0, "squad-articles-proxy")],
        ),
    ),
    Table(
        "articles-8k",
        ("articles_8k.json",),
        (FIDELITY,),
        "TaskSession on squad-articles, --limit 1057 --max-length 8192, one configuration per setting",
        articles_table,
    ),
    Table(
        "length-scaling",
        ("length_scaling_plus.json", "length_scaling_plus_8k.json"),
        (FIDELITY,),
        "python scripts/bench_length_scaling.py --model OUT/minilm-l6-16k --threads 1 "
        '--lengths 2048 4096 8192 16384 --docs 3 --docs-16k 2 --settings default "i-clustered+ cg=0.5" '
        '"i-clustered+ cg=0.25" "i-clustered+ cg=0.5 kg=0.25"',
        length_scaling_table,
    ),
    Table(
        "fidelity-screen",
        ("fidelity_screen.json",),
        (FIDELITY,),
        "python scripts/fidelity_screen.py /tmp/bc-models/minilm-l6-squad --data-dir "
        "../shared/models/minilm-l6-squad/eval --limit 1000 --clusters 10,25 --candidates base lloyd3 qmass "
        "lloyd3+qmass mass90 sinks4 lloyd3+mass90 --lengths --threads 1",
        screen_table,
    ),
    Table(
        "fidelity-cost",
        ("fidelity_cost_idle.json",),
        (FIDELITY,),
        f"{BENCH} --lengths 384 4096 {THREE} --repeats 21 --no-memory",
        cost_table,
    ),
    Table(
        "fidelity-inspect",
        ("inspect_squad_ic/inspect.json", "inspect_squad_icp/inspect.json"),
        (FIDELITY,),
        "bert-cluster inspect /tmp/bc-models/minilm-l6-squad --task squad --data-dir "
        "../shared/models/minilm-l6-squad/eval --limit 16 --max-length 384 -c 25 "
        "--mode i-clustered|i-clustered+ -o DIR",
        inspect_table,
    ),
    Table(
        "fidelity-clusters",
        ("glue_results.json", "squad_results.json"),
        (FIDELITY,),
        'bert-cluster evaluate "/tmp/bc-models/minilm-l6-{task}" --task rte,mrpc,stsb,sst2 '
        "--clusters 10,25,50,100 --seeds 3 --data-dir ../shared/data -o DIR; the same for squad with "
        "--limit 500",
        seeds_table,
    ),
    Table(
        "tune-rte",
        ("tune_rte.json",),
        (USAGE,),
        "bert-cluster tune /tmp/bc-models/minilm-l6-rte --task rte --budget 0.5 --data-dir ../shared/data "
        "-o DIR",
        tune_table,
    ),
    Table(
        "finetune-recovery",
        ("finetune_recovery/rte.json", "finetune_recovery/mrpc.json"),
        (FIDELITY, FINETUNE),
        "python scripts/finetune_recovery.py --models OUT --tasks TASK --seeds 3 --epochs 1 --max-length L "
        "--data-dir ../shared/data --work DIR --output FILE (rte: L 256; mrpc: 128)",
        recovery_table,
    ),
    Table(
        "finetune-recovery-squad",
        ("finetune_recovery/squad-half.json",),
        (README, FIDELITY, FINETUNE),
        "python scripts/finetune_recovery.py --models OUT --tasks squad-half --seeds 3 --epochs 1 "
        "--max-length 384 --data-dir ../shared/data --work DIR --output FILE (in parts: then with --resume)",
        recovery_table,
    ),
    Table(
        "finetune-recovery-rte-gentle",
        ("finetune_recovery/rte_lr1e-4.json",),
        (FINETUNE,),
        "python scripts/finetune_recovery.py --models OUT --tasks rte --seeds 3 --epochs 1 --max-length 256 "
        "--learning-rate 1e-4 --data-dir ../shared/data --work DIR --output FILE",
        recovery_table,
    ),
    Table(
        "finetune-recovery-distill",
        (
            "finetune_recovery/rte_distill.json",
            "finetune_recovery/mrpc_distill.json",
            "finetune_recovery/squad-half_distill.json",
        ),
        (FIDELITY, FINETUNE),
        "python scripts/finetune_recovery.py --models OUT --tasks TASK --seeds S --epochs 1 --max-length L "
        "--learning-rate 1e-4 --distill 1 --data-dir ../shared/data --work DIR --output FILE "
        "(rte: S 3, L 256; mrpc: S 3, L 128; squad-half: S 1, L 384, --arms clustered)",
        recovery_table,
    ),
    Table(
        "finetune-recovery-distill-squad",
        ("finetune_recovery/squad-half_distill_lr5e-4.json",),
        (FINETUNE,),
        "python scripts/finetune_recovery.py --models OUT --tasks squad-half --seeds 1 --epochs 1 "
        "--max-length 384 --learning-rate 5e-4 --distill 1 --arms clustered --data-dir ../shared/data "
        "--work DIR --output FILE",
        recovery_table,
    ),
    Table(
        "long-document-training-zen4",
        ("long_document_training_zen4/training.json",),
        (),
        "python scripts/long_document_training.py --budgets 600 1200 2400 --questions-per-article 1 "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_training_table,
        superseded_by="long-document-training",
    ),
    Table(
        "long-document-training",
        (
            "long_document_training_xeon_amx/training.json",
            "long_document_training_xeon_amx/training_seed1.json",
            "long_document_training_xeon_amx/training_seed2.json",
            "long_document_training_xeon_amx/training_seed3.json",
        ),
        (README, FINETUNE),
        "python scripts/long_document_training.py --budgets 300 600 1200 --seed 0|1|2|3 "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_training_table,
    ),
    Table(
        "long-document-training-zen1",
        ("long_document_training_zen1/training.json",),
        (FINETUNE,),
        "python scripts/long_document_training.py --budgets 300 600 1200 --seed 0 "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_training_table,
    ),
    Table(
        "long-document-training-zen3",
        ("long_document_training_zen3/training.json",),
        (FINETUNE,),
        "python scripts/long_document_training.py --budgets 300 600 1200 --seed 0 --score-exact-too "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_training_table,
    ),
    Table(
        "long-document-training-claim",
        (
            "long_document_training_xeon_amx/training.json",
            "long_document_training_xeon_amx/training_seed1.json",
            "long_document_training_xeon_amx/training_seed2.json",
            "long_document_training_xeon_amx/training_seed3.json",
            "long_document_training_zen1/training.json",
            "long_document_training_zen1/training_1800.json",
            "long_document_training_zen1/training_1800_seed1.json",
            "long_document_training_zen1/training_1800_seed2.json",
            "long_document_training_zen3/training.json",
        ),
        (FINETUNE,),
        "python scripts/render_results.py",
        long_document_claim_table,
    ),
    Table(
        "long-document-training-zen1-rescored",
        (
            "long_document_training_zen1/training.json",
            "long_document_training_zen1/clustered_scored_exact.json",
        ),
        (FINETUNE,),
        "python scripts/long_document_training.py --budgets 300 600 1200 --seed 0 --variants clustered "
        "--score-exact-too --minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_rescored_table,
    ),
    Table(
        "long-document-training-zen1-1800",
        (
            "long_document_training_zen1/training_1800.json",
            "long_document_training_zen1/training_1800_seed1.json",
            "long_document_training_zen1/training_1800_seed2.json",
        ),
        (FINETUNE,),
        "python scripts/long_document_training.py --budgets 450 900 1800 --seed 0|1|2 --score-exact-too "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_training_table,
    ),
    Table(
        "long-document-fidelity-zen1",
        ("long_document_training_zen1/fidelity.json",),
        (FINETUNE,),
        "python scripts/long_document_fidelity.py --minilm-16k OUT/minilm-l6-16k --settings defaults "
        "cluster_growth=0.75 cluster_growth=1 topk_growth=0.75 cluster_growth=0.75,topk_growth=0.75 "
        "--output FILE",
        long_document_fidelity_table,
    ),
    Table(
        "long-document-training-recipes",
        (
            "long_document_training_xeon_amx/recipe_1_in-batch.json",
            "long_document_training_xeon_amx/recipe_16_in-batch.json",
            "long_document_training_xeon_amx/recipe_16_bank.json",
        ),
        (FINETUNE,),
        "python scripts/long_document_training.py --variants exact --length 1024 --budgets 100 200 400 "
        "--eval-every 4 --eval-batch-size 8 --questions-per-article 1|16 --negatives in-batch|bank "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_recipes_table,
    ),
    Table(
        "long-document-training-learning-rate-zen3",
        (
            "long_document_training_zen3/learning_rate_5e-6.json",
            "long_document_training_zen3/learning_rate_2e-5.json",
            "long_document_training_zen3/learning_rate_1e-4.json",
        ),
        (FINETUNE,),
        "python scripts/long_document_training.py --variants exact --length 1024 --budgets 100 200 400 "
        "--eval-every 4 --eval-batch-size 8 --learning-rate 5e-6|2e-5|1e-4 "
        "--minilm-16k OUT/minilm-l6-16k --output FILE",
        long_document_recipes_table,
    ),
    Table(
        "training-call-zen4",
        ("bench_training_zen4/attention.json",),
        (BENCHMARKS,),
        "python scripts/bench_training.py --parts attention --repeats 3 --output FILE",
        training_call_table,
    ),
    Table(
        "training-dropout-zen4",
        ("bench_training_zen4/dropout.json",),
        (TRAINING,),
        "python scripts/bench_training.py --parts attention --lengths 2048 8192 --dtypes fp32 "
        "--dropout 0 0.1 --repeats 3 --output FILE",
        training_dropout_table,
    ),
    Table(
        "training-step-zen4",
        ("bench_training_zen4/step.json",),
        (README, BENCHMARKS),
        "python scripts/bench_training.py --parts step --train-repeats 2 --minilm-16k OUT/minilm-l6-16k "
        "--output FILE",
        training_step_table,
    ),
    Table(
        "embed-memory-zen4",
        ("bench_embed_memory/zen4.json", "bench_embed_memory/zen4_throughput_50k.json"),
        (EMBED,),
        "python scripts/bench_embed_memory.py --documents 100000 1000000 --baseline OLD-CHECKOUT "
        "--baseline-documents 100000 --output FILE; --documents 50000 --baseline-documents 50000 "
        "(throughput)",
        embed_memory_table,
    ),
    Table(
        "boundary-zen4",
        ("bench_boundary_zen4/boundary.json",),
        (BENCHMARKS,),
        "python scripts/bench_boundary.py --threads 1|2 --rounds 30 (before: the code at cad4b64 with its "
        "libraries; after: the no-copy layout), pairs run one after the other",
        boundary_table,
    ),
    Table(
        "serve-zen4",
        ("serve/serve_zen4.json",),
        (README, "docs/serve.md"),
        "nice -n -5 python -m benchmarks.serve --model OUT/minilm-l6-16k --threads 1 --logs DIR "
        "--output FILE",
        serve_table,
    ),
)

#: docs/benchmarks.md's sections, in its order; the README's summary has a row per kind, in this order.
CPU_KINDS: tuple[CpuKind, ...] = (
    CpuKind(
        "zen5",
        "AMD EPYC Zen 5 (AVX-512)",
        attention="speed-zen5",
        peers="peers-zen5",
        others=("speed-zen5-mixed", "speed-zen5-long", "model-zen5"),
    ),
    CpuKind(
        "zen4",
        "AMD EPYC Zen 4 (AVX-512)",
        training="training-step-zen4",
        others=("training-call-zen4", "boundary-zen4"),
    ),
    CpuKind(
        "icelake",
        "Intel Xeon Ice Lake (AVX-512, no BF16)",
        attention="speed-icelake",
        peers="peers-icelake",
    ),
    CpuKind(
        "emerald",
        "Intel Xeon Emerald Rapids (AVX-512 BF16, no AMX)",
        attention="speed-emerald",
        long="long-emerald",
        others=("speed-emerald-mixed", "model-emerald-bf16"),
    ),
    CpuKind(
        "zen3",
        "AMD EPYC Zen 3 (AVX2)",
        attention="speed-zen3",
        long="long-zen3",
        peers="peers-zen3",
        others=("speed-zen3-mixed", "linears-zen3"),
    ),
    CpuKind(
        "zen1",
        "AMD EPYC Zen 1 (AVX2)",
        attention="speed-zen1",
        long="long-zen1",
        peers="peers-zen1",
        others=("linears-zen1",),
    ),
    CpuKind(
        "xeon-amx",
        "Intel Xeon with AMX (AVX-512 BF16, AMX)",
        attention="speed-xeon-amx",
        long="long-xeon-amx",
        peers="peers-xeon-amx",
        others=("linears-xeon-amx", "model-xeon-amx-bf16", "long-documents"),
    ),
)


def derived_tables(measured: Sequence[Table], kinds: Sequence[CpuKind]) -> tuple[Table, ...]:
    """Each CPU kind's machine table and the README's summary, from the kinds' current tables' files."""
    by_name = {t.name: t for t in measured}
    out = []
    for kind in kinds:
        mine = [by_name[name] for name in kind.tables()]
        out.append(
            Table(
                f"cpu-{kind.key}",
                tuple(source for t in mine for source in t.sources),
                (BENCHMARKS,),
                "(the files of the section's tables, as they recorded their machine)",
                machine_table([(t.name, len(t.sources)) for t in mine]),
            )
        )
    parts = [by_name[name] for kind in kinds for name in kind.parts().values()]
    out.append(
        Table(
            "summary-cpus",
            tuple(source for t in parts for source in t.sources),
            (README,),
            "(the files of each CPU kind's tables in docs/benchmarks.md)",
            summary_table(kinds, {t.name: len(t.sources) for t in parts}),
        )
    )
    return tuple(out)


TABLES: tuple[Table, ...] = MEASURED + derived_tables(MEASURED, CPU_KINDS)

#: Files kept under docs/results/ that no table renders: the pages show them as images or link them.
EXTRA_FILES: dict[str, tuple[str, str]] = {
    "glue_scores.png": ("the plot of the fidelity-clusters GLUE run", FIDELITY),
    "squad_scores.png": ("the plot of the fidelity-clusters SQuAD run", FIDELITY),
    "tune_rte.png": ("the plot of the tune-rte run", USAGE),
    "inspect_squad_ic/inspect.png": ("the heatmap of the fidelity-inspect i-clustered run", FIDELITY),
    "inspect_squad_icp/inspect.png": ("the heatmap of the fidelity-inspect i-clustered+ run", FIDELITY),
    "demo_sample/results.md": ("the demo run's own tables (evaluate writes them)", FIDELITY),
    "demo_sample/scores.png": ("the demo run's plot", FIDELITY),
    "demo_plus/results.md": ("the full-size demo run's own tables", FIDELITY),
    "demo_plus/scores.png": ("the full-size demo run's plot", FIDELITY),
    "peers_icelake/bench_peers.png": ("the plot of the peers-icelake run", BENCHMARKS),
    "peers_zen1/bench_peers.png": ("the plot of the peers-zen1 run", BENCHMARKS),
    "peers_zen3/bench_peers.png": ("the plot of the peers-zen3 run", BENCHMARKS),
    "peers_xeon_amx/bench_peers.png": ("the plot of the peers-xeon-amx run", BENCHMARKS),
    "bench_training_zen4/training.png": (
        "the plot of the training-call-zen4 and training-step-zen4 runs (bench_training.py --summarise)",
        BENCHMARKS,
    ),
    "demo_plus_articles/results.md": ("the articles run's own tables", FIDELITY),
    "fidelity_glue25/results.md": ("that run's own tables", FIDELITY),
    "fidelity_glue25/scores.png": ("that run's plot", FIDELITY),
    "fidelity_glue25_default/results.md": ("that run's own tables", FIDELITY),
    "fidelity_glue25_default/scores.png": ("that run's plot", FIDELITY),
    "long_document_training_zen4/training.png": (
        "the plot of the long-document-training-zen4 run: training loss and held-out R@1 against time",
        "CHANGELOG.md",
    ),
    "long_document_training_zen4/training.md": ("that run's own table", "CHANGELOG.md"),
    "long_document_training_xeon_amx/training.png": (
        "the plot of the long-document-training run: training loss and held-out R@1 against training time",
        FINETUNE,
    ),
    "long_document_training_xeon_amx/training.md": ("that run's own table", FINETUNE),
    "long_document_training_zen1/training.png": (
        "the plot of the long-document-training-zen1 run: training loss and held-out R@1 against time",
        FINETUNE,
    ),
    "long_document_training_zen1/training.md": ("that run's own table", FINETUNE),
    "long_document_training_zen3/training.png": (
        "the plot of the long-document-training-zen3 run: training loss and held-out R@1 against time",
        FINETUNE,
    ),
    "long_document_training_zen3/training.md": ("that run's own table", FINETUNE),
    "long_document_training_zen1/training_1800.png": (
        "the plot of the long-document-training-zen1-1800 run: training loss and held-out R@1 against time",
        FINETUNE,
    ),
    "long_document_training_zen1/training_1800.md": ("that run's own table", FINETUNE),
    "long_document_training_zen1/training_1800_seed1.png": (
        "the plot of the long-document-training-zen1-1800 run's seed 1: training loss and held-out R@1 "
        "against time",
        FINETUNE,
    ),
    "long_document_training_zen1/training_1800_seed1.md": ("that run's own table", FINETUNE),
    "long_document_training_zen1/training_1800_seed2.png": (
        "the plot of the long-document-training-zen1-1800 run's seed 2: training loss and held-out R@1 "
        "against time",
        FINETUNE,
    ),
    "long_document_training_zen1/training_1800_seed2.md": ("that run's own table", FINETUNE),
    "long_document_training_zen1/seeds_1800.png": (
        "every seed of the long-document-training-zen1-1800 run: held-out R@1 against training time, and "
        "clustered minus exact at each budget (scripts/long_document_training.py --plot-seeds)",
        FINETUNE,
    ),
    "long_document_training_xeon_amx/seeds.png": (
        "every seed of the long-document-training runs: held-out R@1 against training time, and clustered "
        "minus exact at each budget (scripts/long_document_training.py --plot-seeds)",
        FINETUNE,
    ),
    "finetune_recovery/rte_distill_agreement.json": (
        "KL and class agreement of the finetune-recovery-distill RTE models with the checkpoint's unmodified "
        "predictions (scripts/prediction_agreement.py)",
        FINETUNE,
    ),
    "finetune_recovery/mrpc_distill_agreement.json": ("the same for MRPC", FINETUNE),
}
INDEX = f"{RESULTS}/README.md"
CHANGELOG = "CHANGELOG.md"


def index_table(_: list[dict]) -> list[str]:
    """Every kept results file: which table renders it (and the command), or which page shows it.

    A superseded table's files are listed as such, cited by CHANGELOG.md, where their figures are quoted.
    """
    rows = []
    for entry in TABLES:
        if entry.superseded_by:
            pages = f"[{CHANGELOG}](../../{CHANGELOG})"
            state = f"superseded by `{entry.superseded_by}`"
        else:
            pages = ", ".join(f"[{Path(d).name}](../../{d})" for d in entry.documents)
            state = "current"
        files = "<br>".join(f"`{source}`" for source in entry.sources)
        rows.append([files, f"`{entry.name}`", state, pages, f"`{entry.command}`"])
    for source, (what, page) in EXTRA_FILES.items():
        rows.append([f"`{source}`", "", "", f"[{Path(page).name}](../../{page})", what])
    return table(["files", "table", "state", "cited by", "made by"], "lllll", rows)


INDEX_TABLE = Table("results-index", (), (INDEX,), "", index_table)


# ---------------------------------------------------------------------------------------------------------
# Rendering and checking


def load(root: Path, entry: Table) -> list[dict]:
    return [json.loads((root / RESULTS / source).read_text(encoding="utf-8")) for source in entry.sources]


def rendering(root: Path, entry: Table) -> str:
    """The region's body: the table, its caption and the files it came from."""
    lines = entry.render(load(root, entry))
    if entry.sources:
        lines.append("Source: " + ", ".join(f"`{RESULTS}/{s}`" for s in entry.sources) + ".")
        lines.append(f"Made by: `{entry.command}`.")
    return "\n" + "\n".join(lines) + "\n\n"


def render_document(root: Path, document: str, entries: Sequence[Table]) -> tuple[str, str, list[str]]:
    """(current text, rendered text, problems) for one document."""
    text = (root / document).read_text(encoding="utf-8")
    by_name = {e.name: e for e in entries}
    superseded = {e.name: e.superseded_by for e in TABLES if e.superseded_by}
    problems = []
    found = set()

    def replace(match: re.Match) -> str:
        name = match["name"]
        found.add(name)
        if name in superseded:
            problems.append(
                f"{document}: table {name!r} is superseded by {superseded[name]!r}: its region belongs in "
                f"no page (quote its figures in {CHANGELOG})"
            )
            return match[0]
        if name not in by_name:
            problems.append(f"{document}: table {name!r} is not registered for this document")
            return match[0]
        return f"<!-- table: {name} -->\n{rendering(root, by_name[name])}<!-- /table -->"

    new = MARKER.sub(replace, text)
    problems += [f"{document}: no region for table {n!r}" for n in by_name if n not in found]
    return text, new, problems


def superseded_problems(root: Path) -> list[str]:
    """A superseded table names a current one, is on no page, is quoted in CHANGELOG.md and still renders."""
    current = {e.name for e in TABLES if not e.superseded_by}
    changelog = (root / CHANGELOG).read_text(encoding="utf-8")
    problems = []
    for entry in TABLES:
        if not entry.superseded_by:
            continue
        if entry.superseded_by not in current:
            problems.append(
                f"table {entry.name!r}: superseded by {entry.superseded_by!r}, not a current table"
            )
        if entry.documents:
            problems.append(
                f"table {entry.name!r} is superseded yet registered for {', '.join(entry.documents)}"
            )
        problems += [
            f"{CHANGELOG} does not quote superseded table {entry.name!r}'s file {RESULTS}/{source}"
            for source in entry.sources
            if f"{RESULTS}/{source}" not in changelog
        ]
        try:
            entry.render(load(root, entry))
        except (OSError, KeyError, ValueError, TypeError, IndexError) as error:
            problems.append(f"table {entry.name!r} (superseded) no longer renders: {error!r}")
    return problems


def run(root: Path, check: bool) -> list[str]:
    """Render (or check) every document; returns the stale regions and other problems."""
    documents: dict[str, list[Table]] = {}
    for entry in (*TABLES, INDEX_TABLE):
        for document in entry.documents:
            documents.setdefault(document, []).append(entry)
    problems = superseded_problems(root)
    for document, entries in documents.items():
        text, new, found = render_document(root, document, entries)
        problems += found
        if new != text:
            if check:
                old = {m["name"]: m["body"] for m in MARKER.finditer(text)}
                current = {m["name"]: m["body"] for m in MARKER.finditer(new)}
                problems += [
                    f"{document}: table {n!r} differs from its results"
                    for n in current
                    if old.get(n) != current[n]
                ]
            else:
                (root / document).write_text(new, encoding="utf-8")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository root (default: this checkout)"
    )
    args = parser.parse_args(argv)
    problems = run(args.root, args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
