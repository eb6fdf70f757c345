"""The paper's training claim on long documents (issue 40, item 3): at an equal wall-clock budget, does a
text encoder trained with clustered attention end better than one trained with exact attention?

The recipe is the task ``squad-articles-train`` (``configs/tasks/long/squad_articles_train.yaml``, kind
long-retrieval): contrastive fine-tuning of the MiniLM-16k proxy (all-MiniLM-L6-v2 with its 512 positions
copied to 16,384, ``bert_cluster.tasks.proxy``; the same weights as ``../shared/models/build.py OUT
minilm-l6-16k``) on SQuAD v1.1 dev as long-document retrieval: the questions of articles 1-24 against
their article, cut at ``--length`` tokens (4,096), 16 questions sharing one article embedding; scored on
articles 25-48 (R@1, MRR@10, x 100), each model with the attention it was trained with. This script trains
nothing itself: each arm is one ``bert_cluster.finetune`` run (Trainer) with a budget of training time
(``max_seconds``, scoring excluded) and the held-out split scored at each budget (``eval_at``); the script
puts both arms' reports into one results file, its verdicts, table and plot.

Both runs train without attention dropout (``--attention-dropout``, default 0): torch's CPU flash kernel
has no dropout, and with it the exact run's SDPA falls back to the math path, which keeps every N x N
probability for the backward (15.8 GiB for one 4,096-token article; a batch of 4 does not fit in 24 GiB).

Two runs, one after the other, on the same machine and threads: ``exact`` (the model unmodified, torch's
SDPA) and ``clustered`` (``bert_cluster.convert``'s defaults, or ``--clusters``, ``--mode``,
``--cluster-growth``, ``--topk-growth``, ``--min-length``). Same seed and data order for both. The
verdicts: at every budget the clustered run scores at least the exact run's (R@1), and the clustered run
reaches the exact run's final R@1 within half the exact run's time. Writes JSON, a Markdown table and a
plot (loss and R@1 against training time).

    python -m benchmarks.long_document_training --budgets 300 600 1200 --seed 0 \\
        --output docs/results/long_document_training_xeon_amx/training.json
    python -m benchmarks.long_document_training --budgets 60 120 --length 1024 --eval-every 4   # a short try
    python -m benchmarks.long_document_training --plot-seeds training.json training_seed1.json ... \\
        --output docs/results/long_document_training_xeon_amx/seeds.png   # every seed in one figure
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from benchmarks.harness import environment, load_average

VARIANTS = ("exact", "clustered")
#: The task that holds the recipe (its train split, held-out split and loss).
TASK = "squad-articles-train"
#: Held-out questions (articles 25-48), what ``--eval-every`` divides.
HELD_OUT_QUESTIONS = 4874


def split(task: str, eval_every: int, length: int) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The task's training pairs (question, its article cut at ``length`` tokens) and its held-out queries
    (every ``eval_every``-th), corpus and gold, read as ``finetune`` reads them (the retrieval kind)."""
    from bert_cluster.tasks import get_tasks
    from bert_cluster.tasks.kinds.long_retrieval import split_articles

    (config,) = get_tasks(task)
    training = split_articles(config, "train", length)
    pairs = [
        (question, training.documents[gold])
        for question, gold in zip(training.questions, training.gold, strict=True)
    ]
    scored = split_articles(config, "dev", length)
    held_out = list(zip(scored.question_ids, scored.questions, scored.gold, strict=True))[::eval_every]
    return pairs, {
        "queries": {qid: question for qid, question, _ in held_out},
        "corpus": dict(zip(scored.titles, scored.documents, strict=True)),
        "relevant": {qid: {scored.titles[gold]} for qid, _, gold in held_out},
    }


def proxy_folder(folder: str | None, cache: str | None) -> str:
    """The MiniLM-16k proxy: the folder given, else built once into the cache."""
    if folder is not None:
        return folder
    from bert_cluster.checkpoints import default_model_path
    from bert_cluster.tasks.proxy import long_position_proxy

    return str(long_position_proxy(default_model_path(), 16384, cache=cache))


def run_variant(variant: str, args) -> dict[str, Any]:
    """One arm: ``bert_cluster.finetune`` on the task until the last budget, scored at every budget."""
    import bert_cluster
    from bert_cluster.config import ClusteredAttentionConfig

    clustered = variant == "clustered"
    result = bert_cluster.finetune(
        proxy_folder(args.minilm_16k, args.cache),
        args.task,
        Path(args.work) / variant,
        attention=ClusteredAttentionConfig.for_convert(**args.convert) if clustered else None,
        exact=not clustered,
        lora=False,
        epochs=args.max_epochs,
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        seed=args.seed,
        save_steps=args.save_steps,
        overwrite=True,
        max_length=args.length,
        attention_dropout=args.attention_dropout,
        max_seconds=max(args.budgets),
        eval_at=[0, *args.budgets],
        eval_limit=math.ceil(HELD_OUT_QUESTIONS / args.eval_every),
        eval_exact=clustered and args.score_exact_too,
        schedule="linear",
    )
    points = []
    for entry in result.evaluations:
        point = {"budget": entry["mark"], "seconds": entry["seconds"], "step": entry["step"]}
        point.update(_scores(entry["scores"]))
        if "exact_attention" in entry:
            point["exact_attention"] = _scores(entry["exact_attention"])
        points.append(point)
        print(f"  {variant} at {entry['mark']:g} s: R@1 {point['R@1']:.1f}")
    seconds = {entry["step"]: entry["seconds"] for entry in result.clock_curve}
    curve = [{"seconds": seconds[c["step"]], "step": c["step"], "loss": c["loss"]} for c in result.loss_curve]
    reached = {p["budget"] for p in points}
    return {
        "points": points,
        "curve": curve,
        "unreached_budgets": [b for b in args.budgets if b not in reached],
    }


def _scores(scores: dict[str, float]) -> dict[str, float]:
    return {"R@1": scores["recall@1"], "MRR@10": scores["mrr@10"]}


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's two targets, read off the scores (None where a run did not reach its budgets)."""
    exact = {p["budget"]: p for p in result["variants"]["exact"]["points"] if p["budget"]}
    clustered = {p["budget"]: p for p in result["variants"]["clustered"]["points"] if p["budget"]}
    shared = sorted(set(exact) & set(clustered))
    if not shared:
        return {"at_least_exact_at_every_budget": None, "exact_final_within_half_time": None}
    final = exact[max(exact)]
    reached = [p["seconds"] for b, p in sorted(clustered.items()) if p["R@1"] >= final["R@1"]]
    return {
        "at_least_exact_at_every_budget": all(clustered[b]["R@1"] >= exact[b]["R@1"] for b in shared),
        "exact_final_R@1": final["R@1"],
        "clustered_seconds_to_exact_final": reached[0] if reached else None,
        "exact_final_within_half_time": bool(reached) and reached[0] <= final["seconds"] / 2,
    }


def table(result: dict[str, Any]) -> str:
    both = any("exact_attention" in p for p in result["variants"]["clustered"]["points"])
    extra = " clustered R@1, scored exact |" if both else ""
    lines = [
        "| training time (s) | exact R@1 | clustered R@1 | exact MRR@10 | clustered MRR@10 "
        f"| steps (exact / clustered) |{extra}",
        "|---|---|---|---|---|---|" + ("---|" if both else ""),
    ]
    exact = {p["budget"]: p for p in result["variants"]["exact"]["points"]}
    clustered = {p["budget"]: p for p in result["variants"]["clustered"]["points"]}
    for budget in sorted(set(exact) | set(clustered)):
        e, c = exact.get(budget, {}), clustered.get(budget, {})

        def cell(row: dict, key: str) -> str:
            return f"{row[key]:.1f}" if key in row else "-"

        lines.append(
            f"| {budget:g} | {cell(e, 'R@1')} | {cell(c, 'R@1')} | {cell(e, 'MRR@10')} | {cell(c, 'MRR@10')} "
            f"| {e.get('step', '-')} / {c.get('step', '-')} |"
            + (f" {cell(c.get('exact_attention', {}), 'R@1')} |" if both else "")
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, scores) = plt.subplots(1, 2, figsize=(10, 4))
    for variant, data in result["variants"].items():
        curve = data["curve"]
        losses.plot([c["seconds"] for c in curve], [c["loss"] for c in curve], label=variant, alpha=0.8)
        points = data["points"]
        scores.plot([p["seconds"] for p in points], [p["R@1"] for p in points], marker="o", label=variant)
        if any("exact_attention" in p for p in points):
            rescored = [p for p in points if "exact_attention" in p]
            scores.plot([p["seconds"] for p in rescored], [p["exact_attention"]["R@1"] for p in rescored],
                        marker="x", linestyle="--", label=f"{variant}, scored exact")  # fmt: skip
    losses.set(xlabel="training time (s)", ylabel="training loss", title="loss")
    scores.set(xlabel="training time (s)", ylabel="held-out R@1", title="articles 25-48")
    for axes in (losses, scores):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.suptitle(f"MiniLM-16k proxy, {result['settings']['length']} tokens: exact vs clustered training")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _at(result: dict[str, Any], variant: str) -> dict[float, dict[str, Any]]:
    return {p["budget"]: p for p in result["variants"][variant]["points"]}


def differences_at_budgets(results: list[dict[str, Any]]) -> dict[float, list[float]]:
    """Clustered R@1 minus exact R@1 at each budget every run reached, one value per run (seed)."""
    shared = set.intersection(*(set(_at(r, v)) for r in results for v in VARIANTS)) - {0}
    return {
        b: [_at(r, "clustered")[b]["R@1"] - _at(r, "exact")[b]["R@1"] for r in results]
        for b in sorted(shared)
    }


def plot_seeds(results: list[dict[str, Any]], path: Path) -> None:
    """Several seeds' runs in one figure: held-out R@1 against training time (each seed thin, the mean at
    each budget thick) and, per budget, clustered minus exact for each seed and their mean."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"exact": "tab:blue", "clustered": "tab:orange"}
    differences = differences_at_budgets(results)
    figure, (scores, gaps) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, colour in colours.items():
        for result in results:
            points = result["variants"][variant]["points"]
            scores.plot([p["seconds"] for p in points], [p["R@1"] for p in points], color=colour, alpha=0.25)
        means = [[_at(r, variant)[b] for r in results] for b in [0, *differences]]
        scores.plot(
            [statistics.mean(p["seconds"] for p in group) for group in means],
            [statistics.mean(p["R@1"] for p in group) for group in means],
            color=colour, marker="o", linewidth=2.5, label=f"{variant}, mean of {len(results)} seeds",
        )  # fmt: skip
    budgets = list(differences)
    for index, result in enumerate(results):
        seed = result["settings"]["seed"]
        colour = plt.get_cmap("tab10")(2 + index % 8)  # not the variants' blue and orange
        gaps.plot(budgets, [d[index] for d in differences.values()], marker=".", color=colour, alpha=0.6,
                  label=f"seed {seed}")  # fmt: skip
    mean = [statistics.mean(d) for d in differences.values()]
    gaps.plot(budgets, mean, color="black", marker="o", linewidth=2.5, label="mean")
    gaps.axhline(0, color="grey", linewidth=1)
    scores.set(xlabel="training time (s)", ylabel="held-out R@1", title="articles 25-48")
    gaps.set(xlabel="training budget (s)", ylabel="clustered R@1 - exact R@1 (points)", title="at equal time")
    for axes in (scores, gaps):
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
    length = results[0]["settings"]["length"]
    figure.suptitle(f"MiniLM-16k proxy, {length:,} tokens: exact vs clustered training, every seed")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[600, 1200, 2400], help="seconds")
    parser.add_argument("--length", type=int, default=4096, help="tokens per article")
    parser.add_argument("--batch-size", type=int, default=4, help="questions (and articles) per step")
    parser.add_argument(
        "--task",
        default=TASK,
        help="the recipe's task; its variants replace the former --negatives bank "
        "(squad-articles-train-bank) and --questions-per-article 1 (squad-articles-train-one-question); "
        "another is a task file that includes configs/tasks/long/squad_articles_train.yaml",
    )
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--max-epochs", type=float, default=100.0, help="a bound; the budgets stop training")
    parser.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="both runs' attention dropout (0: torch's CPU flash kernel has none; with it SDPA falls back to "
        "the math path, which keeps every N x N probability: 15.8 GiB for one 4,096-token article)",
    )
    parser.add_argument("--clusters", type=int, help="clustered run's C (default: convert's)")
    parser.add_argument("--mode", help="clustered run's mode (default: convert's)")
    parser.add_argument(
        "--min-length", type=int, help="clustered run's min_length (default: convert's, auto; 0: every row)"
    )
    for growth in ("cluster-growth", "topk-growth"):
        parser.add_argument(
            f"--{growth}",
            type=float,
            help=f"clustered run's {growth.replace('-', '_')}, how C or k grows past 512 tokens (default: "
            "convert's, 0.5)",
        )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--eval-every", type=int, default=1, help="score every n-th held-out question")
    parser.add_argument("--save-steps", type=int, default=500, help="a checkpoint every N steps (--work)")
    parser.add_argument(
        "--score-exact-too",
        action="store_true",
        help="also score the clustered run's copies with exact attention (training apart from scoring)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", help="where the proxy is built (default: the user cache)")
    parser.add_argument("--minilm-16k", help="a built minilm-l6-16k folder (../shared/models/build.py)")
    parser.add_argument("--work", default="results/long_document_training_work", help="trainer scratch")
    parser.add_argument("--output", type=Path, default=Path("results/long_document_training.json"))
    parser.add_argument(
        "--plot-seeds",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="train nothing: plot these runs (one per seed, same budgets) to --output (a .png)",
    )
    args = parser.parse_args(argv)
    if args.plot_seeds:
        if args.output.suffix != ".png":
            parser.error(f"--plot-seeds writes a .png: give --output FILE.png, got {args.output}")
        missing = [str(path) for path in args.plot_seeds if not path.is_file()]
        if missing:
            parser.error(f"no such results file: {', '.join(missing)}")
        results = [json.loads(path.read_text(encoding="utf-8")) for path in args.plot_seeds]
        incomplete = [
            str(p)
            for p, r in zip(args.plot_seeds, results, strict=True)
            if set(VARIANTS) - set(r["variants"])
        ]
        if incomplete:
            parser.error(f"these runs lack an exact or a clustered run: {', '.join(incomplete)}")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        plot_seeds(results, args.output)
        print(f"wrote {args.output}")
        return 0
    if (
        any(b <= 0 for b in args.budgets)
        or min(args.length, args.batch_size) < 2
        or min(args.eval_every, args.save_steps) < 1
    ):
        parser.error(
            "budgets must be positive, --length >= 2, --batch-size >= 2, --eval-every >= 1, --save-steps >= 1"
        )
    if not 0 <= args.attention_dropout < 1:
        parser.error(f"--attention-dropout must be in [0, 1), got {args.attention_dropout}")
    args.convert = {"backend": "cpu"}
    if args.clusters is not None:
        args.convert["clusters"] = args.clusters
    if args.mode is not None:
        args.convert["mode"] = args.mode
    if args.min_length is not None:
        args.convert["min_length"] = args.min_length
    for name in ("cluster_growth", "topk_growth"):
        value = getattr(args, name)
        if value is not None:
            if not 0 <= value <= 1:
                option = f"--{name.replace('_', '-')}"
                parser.error(f"{option} must be in 0..1 (0: fixed, 1: linear), got {value:g}")
            args.convert[name] = value

    import torch

    import bert_cluster
    from bert_cluster.environment import cpu_name

    torch.set_num_threads(args.threads)
    pairs, held_out = split(args.task, args.eval_every, args.length)
    print(f"{len(pairs)} training pairs, about {len(held_out['queries'])} held-out questions, "
          f"{len(held_out['corpus'])} held-out articles; budgets {args.budgets} s")  # fmt: skip
    load_before = load_average()
    variants = {variant: run_variant(variant, args) for variant in args.variants}
    result = {
        "settings": {
            key: value if not isinstance(value, Path) else str(value)
            for key, value in vars(args).items()
            if key not in {"work", "output"}
        },
        "data": {"train_pairs": len(pairs), "held_out_questions": len(held_out["queries"])},
        "variants": variants,
        "environment": {
            **environment(args.threads),
            "processor": cpu_name(),
            "kernels_cpu_isa": bert_cluster.info().get("kernels_cpu_isa"),
            "load_before": load_before,
            "load_after": load_average(),
        },
    }
    if set(VARIANTS) <= set(variants):
        result["verdicts"] = verdicts(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    if set(VARIANTS) <= set(variants):
        markdown = table(result)
        args.output.with_suffix(".md").write_text(markdown + "\n", encoding="utf-8")
        plot(result, args.output.with_suffix(".png"))
        print(markdown)
        print(json.dumps(result["verdicts"], indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
