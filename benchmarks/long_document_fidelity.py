"""What clustered attention costs the long-document retrieval of ``benchmarks.long_document_training`` before
any training, per convert setting: held-out R@1 of the untrained MiniLM-16k proxy, on the training split
too.

The question the training runs left open (issue 40, item 3): the clustered run starts 0.2-0.3 R@1 below the
exact one; is that a cost a larger C or k removes, or scatter of the size the training differences have?
Each setting converts the proxy, embeds the 24 training and the 24 held-out articles at ``--length``
tokens, and scores each split's questions against its articles (R@1 x 100, the training task's split and
cut). Questions are embedded once, unmodified: convert's ``min_length="auto"`` keeps rows that short exact
(checked on the first 64 questions of each setting). Also the mean cosine of the article embeddings to
exact, the questions each setting gains and loses against exact (a net change of a few questions can be
the balance of many flips), and the seconds of one training article's forward and backward (the costly
part of a step).

    python -m benchmarks.long_document_fidelity --minilm-16k OUT/minilm-l6-16k \\
        --settings defaults cluster_growth=0.75 cluster_growth=1 topk_growth=0.75 \\
        --output docs/results/long_document_training_zen1/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    environment,
    joined,
    signed,
    table_lines,
    times,
)

SETTINGS = ("clusters", "topk", "mode", "cluster_growth", "topk_growth")


def parse_setting(text: str) -> dict[str, Any]:
    """``defaults`` or ``name=value[,name=value]`` with names from SETTINGS."""
    if text == "defaults":
        return {}
    setting: dict[str, Any] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in SETTINGS or not value:
            raise ValueError(f"a setting is 'defaults' or name=value[,...] with names {', '.join(SETTINGS)}")
        try:
            setting[name] = value if name == "mode" else json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{name} takes a number, got {value!r}") from None
    return setting


#: The task that holds the long-document training recipe (its train and held-out splits).
TASK = "squad-articles-train"


def splits(length: int) -> dict[str, dict[str, Any]]:
    """Each split's questions, its 24 articles (cut at ``length`` tokens as training cuts them) and the index
    of each question's article, as the retrieval kind reads the task."""
    from bert_cluster.tasks import get_tasks
    from bert_cluster.tasks.kinds.long_retrieval import split_articles

    (task,) = get_tasks(TASK)
    return {
        name: {"questions": articles.questions, "articles": articles.documents, "gold": articles.gold}
        for name, articles in (
            ("training", split_articles(task, "train", length)),
            ("held_out", split_articles(task, "dev", length)),
        )
    }


def build_model(folder: str) -> Any:
    """The proxy as the recipe trains it: the retrieval kind's training model, attention dropout 0."""
    from bert_cluster.tasks import get_tasks
    from bert_cluster.tasks.kinds.long_retrieval import LONG_RETRIEVAL

    (task,) = get_tasks(TASK)
    return LONG_RETRIEVAL.training_model(folder, task, {"attention_probs_dropout_prob": 0.0}).model


def measure(model, data: dict[str, dict[str, Any]], questions: dict, reference: dict | None) -> dict:
    """R@1 and cosine to ``reference`` (exact's articles and first 64 questions, embedded in the same calls)
    per split, whether the questions equal the unmodified ones, one article's forward + backward seconds."""
    import torch

    out: dict[str, Any] = {}
    articles, probes = {}, {}
    for name, part in data.items():
        with torch.inference_mode():
            embedded = model.encode(
                part["articles"], batch_size=1, convert_to_tensor=True, normalize_embeddings=True
            )
            probe = model.encode(
                part["questions"][:64], batch_size=64, convert_to_tensor=True, normalize_embeddings=True
            )
        articles[name], probes[name] = embedded, probe
        hits = (questions[name] @ embedded.T).argmax(1) == torch.tensor(part["gold"])
        out[name] = {
            "R@1": 100 * hits.double().mean().item(),
            "hits": hits.tolist(),
            "cosine_to_exact": (embedded * reference["articles"][name]).sum(1).mean().item()
            if reference
            else 1.0,
            "questions_exact": bool(torch.equal(probe, reference["probes"][name])) if reference else True,
        }
    model.train()
    features = model.preprocess([data["training"]["articles"][0]])
    start = time.perf_counter()
    model(features)["sentence_embedding"].sum().backward()
    out["forward_backward_seconds"] = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    model.eval()
    return out | {"_reference": {"articles": articles, "probes": probes}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minilm-16k", required=True, help="a built minilm-l6-16k folder")
    parser.add_argument("--length", type=int, default=4096, help="tokens per article")
    parser.add_argument(
        "--settings", nargs="+", default=["defaults"], help="'defaults' or name=value[,name=value]"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/long_document_fidelity.json"))
    args = parser.parse_args(argv)
    from bert_cluster.config import ClusteredAttentionConfig

    try:
        settings = [parse_setting(text) for text in args.settings]
        for setting in settings:
            ClusteredAttentionConfig.for_convert(**setting)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if args.length < 2:
        parser.error(f"--length must be >= 2, got {args.length}")

    import torch

    import bert_cluster

    torch.set_num_threads(args.threads)
    data = splits(args.length)
    model = build_model(args.minilm_16k)
    model.max_seq_length = args.length
    model.eval()
    with torch.inference_mode():
        questions = {
            name: model.encode(
                part["questions"], batch_size=64, convert_to_tensor=True, normalize_embeddings=True
            )
            for name, part in data.items()
        }
    encoder = model[0].auto_model
    exact = measure(model, data, questions, None)
    reference = exact.pop("_reference")
    rows = [{"setting": "exact", **exact}]
    for text, setting in zip(args.settings, settings, strict=True):
        bert_cluster.convert(encoder, **setting)
        try:
            row = measure(model, data, questions, reference)
        finally:
            bert_cluster.revert(encoder)
        row.pop("_reference")
        for name in data:  # questions this setting ranks right that exact does not, and the other way
            pairs = list(zip(row[name].pop("hits"), exact[name]["hits"], strict=True))
            row[name]["gained"] = sum(mine and not theirs for mine, theirs in pairs)
            row[name]["lost"] = sum(theirs and not mine for mine, theirs in pairs)
        clusters, topk = ClusteredAttentionConfig.for_convert(**setting).row_settings(args.length)
        rows.append({"setting": text, "convert": setting, "clusters": clusters, "topk": topk, **row})
        print(
            f"{text}: R@1 training {row['training']['R@1']:.2f} (exact {exact['training']['R@1']:.2f}), "
            f"held-out {row['held_out']['R@1']:.2f} (exact {exact['held_out']['R@1']:.2f}), "
            f"{row['forward_backward_seconds']:.2f} s per article forward + backward",
            flush=True,
        )
    for name in data:
        exact[name].pop("hits")
    result = {
        "settings": {
            "length": args.length,
            "threads": args.threads,
            "train_articles": len(data["training"]["articles"]),
        },
        "data": {name: {"questions": len(part["questions"])} for name, part in data.items()},
        "rows": rows,
        "environment": environment(args.threads),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


# --- tables (benchmarks.render) ----------------------------------------------------------------------


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
    """benchmarks.long_document_training: held-out R@1 and MRR@10 of exact and clustered training at each
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
    return table_lines(header, "r" * len(header), rows) + ["", caption]


def long_document_rescored_table(results: list[dict]) -> list[str]:
    """A both-variant run of benchmarks.long_document_training, then the same command's clustered run again
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
    return table_lines(header, "r" * len(header), rows) + ["", caption]


def long_document_fidelity_table(results: list[dict]) -> list[str]:
    """The untrained proxy's R@1 per convert setting on both splits of the
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
    return table_lines(header, "lr" + "r" * (len(header) - 2), rows) + ["", caption]


#: What a question is scored against in benchmarks.long_document_training's loss (--negatives).
RECIPE_NEGATIVES = {
    "in-batch": "in-batch negatives",
    "bank": "in-batch negatives and the other training articles' last embeddings",
}


def long_document_recipes_table(results: list[dict]) -> list[str]:
    """benchmarks.long_document_training's short exact runs, one per training recipe: does the held-out R@1
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
    return table_lines(header, "lrrr" + "r" * (len(budgets) + 1) + "rr", rows) + ["", caption]


#: The training articles of benchmarks.long_document_training (SQuAD v1.1 dev articles 1-24).
TRAIN_ARTICLES_24 = 24


def long_document_claim_table(results: list[dict], cpus: Sequence[str]) -> list[str]:
    """Every run of benchmarks.long_document_training in one table, each labelled with its CPU kind from
    ``cpus``: at each budget the clustered run's held-out R@1 minus the exact run's, the steps, and the
    run's two verdicts; then all runs together. The verdict on the paper's training claim is stated, not
    inferred: not decided."""
    rows, differences = [], []
    by_cpu: dict[str, list[float]] = {}
    for result, cpu in zip(results, cpus, strict=True):
        exact = {p["budget"]: p for p in result["variants"]["exact"]["points"] if p["budget"]}
        clustered = [p for p in result["variants"]["clustered"]["points"] if p["budget"]]
        exact_points = [exact[p["budget"]] for p in clustered]
        gaps = [p["R@1"] - e["R@1"] for p, e in zip(clustered, exact_points, strict=True)]
        differences += gaps
        by_cpu.setdefault(cpu, []).extend(gaps)
        verdicts = result["verdicts"]
        per_article = result["settings"].get("questions_per_article", 1)
        rows.append(
            [
                cpu
                + (
                    ""
                    if per_article == 16
                    else f", {per_article} question{'s' * (per_article > 1)} per article"
                ),
                str(result["settings"]["seed"]),
                joined([f"{p['budget']:,.0f}" for p in clustered]),
                joined([signed(gap) for gap in gaps]),
                " vs ".join(joined([str(p["step"]) for p in points]) for points in (clustered, exact_points)),
                "met" if verdicts["at_least_exact_at_every_budget"] else "missed",
                "met" if verdicts["exact_final_within_half_time"] else "missed",
            ]
        )
    every = sum(r["verdicts"]["at_least_exact_at_every_budget"] for r in results)
    half = sum(r["verdicts"]["exact_final_within_half_time"] for r in results)
    both = sum(
        r["verdicts"]["at_least_exact_at_every_budget"] and r["verdicts"]["exact_final_within_half_time"]
        for r in results
    )
    rows.append(
        [
            f"all {len(results)} runs",
            "",
            f"{len(differences)} budgets",
            f"mean {signed(statistics.mean(differences))}, {signed(min(differences))} to "
            f"{signed(max(differences))}; at least exact at {sum(d >= 0 for d in differences)} of "
            f"{len(differences)}",
            "",
            f"{every} of {len(results)}",
            f"{half} of {len(results)} (both: {both})",
        ]
    )
    header = [
        "CPU",
        "seed",
        "budgets (s)",
        "clustered − exact R@1",
        "steps, clustered vs exact",
        "at least exact at every budget",
        "exact's final in half the time",
    ]
    caption = (
        "Every run of the paper's training claim on the MiniLM-16k proxy (4,096 tokens; 16 questions per "
        "article unless the row says otherwise): at each budget of training time "
        "the clustered run's held-out R@1 minus the exact run's (x 100, 4,874 questions: 0.02 is one "
        "question), and each run's two targets. Verdict: **not decided**."
    )
    both_ways = [cpu for cpu, gaps in by_cpu.items() if min(gaps) < 0 <= max(gaps)]
    if len(both_ways) == len(by_cpu):
        caption += f" The difference goes both ways on every CPU kind ({len(by_cpu)})."
    return table_lines(header, "lrlllll", rows) + ["", caption]


if __name__ == "__main__":
    sys.exit(main())
