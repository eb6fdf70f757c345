"""The paper's training claim on long documents (issue 40, item 3): at an equal wall-clock budget, does a
text encoder trained with clustered attention end better than one trained with exact attention?

Contrastive fine-tuning of the MiniLM-16k proxy (all-MiniLM-L6-v2 with its 512 positions copied to 16,384,
``bert_cluster.evaluation.proxy``; the same weights as ``../shared/models/build.py OUT minilm-l6-16k``) on
SQuAD v1.1 dev as long-document retrieval: the questions of articles 1-24 against their article, cut at
``--length`` tokens (4,096). A step embeds ``--batch-size`` articles (no article twice) and
``--questions-per-article`` (16) questions of each: one article embedding, the costly part of a step,
trains 16 questions instead of one (with one, the loss was 0.002 within a few steps and the held-out score
never moved). Each question is scored against the step's articles (in-batch negatives; at one question per
article this is sentence-transformers' MultipleNegativesRankingLoss), and with ``--negatives bank`` also
against the other training articles' last embeddings. Scored on articles 25-48: each question against the
24 held-out articles (R@1, MRR@10, x 100), each model with the attention it was trained with.

Both runs train without attention dropout (``--attention-dropout``, default 0): torch's CPU flash kernel
has no dropout, and with it the exact run's SDPA falls back to the math path, which keeps every N x N
probability for the backward (15.8 GiB for one 4,096-token article; a batch of 4 does not fit in 24 GiB).

Two runs in one process, one after the other, on the same machine and threads: ``exact`` (the model
unmodified, torch's SDPA) and ``clustered`` (``bert_cluster.convert``'s defaults, or ``--clusters``,
``--mode``, ``--cluster-growth``, ``--topk-growth``). Each trains until the largest budget of training time
(evaluation excluded) and keeps a copy of its weights as it passes each budget; the copies are scored
after training, so scoring never eats a budget. Same seed and data order for both. The verdicts: at every
budget the clustered run scores at least the exact run's (R@1), and the clustered run reaches the exact
run's final R@1 within half the exact run's time. Writes JSON, a Markdown table and a plot (loss and R@1
against training time).

    python -m scripts.long_document_training --budgets 300 600 1200 --seed 0 \\
        --output docs/results/long_document_training_xeon_amx/training.json
    python -m scripts.long_document_training --budgets 60 120 --length 1024 --eval-every 4   # a short try
    python -m scripts.long_document_training --plot-seeds training.json training_seed1.json ... \\
        --output docs/results/long_document_training_xeon_amx/seeds.png   # every seed in one figure
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import environment, load_average

TRAIN_ARTICLES = 24  # articles 1-24 train, 25-48 are scored (the SQuAD checkpoint's split)
VARIANTS = ("exact", "clustered")


def load_articles():
    """The 48 articles of SQuAD v1.1 dev and their questions (the package's retrieval file)."""
    import gzip

    from bert_cluster.datafiles import PACKAGE_DATA
    from bert_cluster.evaluation.kinds.long_retrieval import articles_from_paragraphs

    with gzip.open(PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz", "rt", encoding="utf-8") as handle:
        document = json.load(handle)
    return articles_from_paragraphs(document["paragraphs"], document["questions"])


#: Articles are cut at this many characters per token of ``--length`` before tokenising (a WordPiece token
#: of English text averages about 4 characters): the tokenizer would otherwise encode each whole article,
#: up to 17.5k tokens, to keep the first 4,096, which made up a third of a short run.
CHARACTERS_PER_TOKEN = 12


def split(articles, eval_every: int, length: int) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Training pairs (question, its article) of articles 1-24; the held-out queries, corpus and gold."""
    documents = [document[: CHARACTERS_PER_TOKEN * length] for document in articles.documents]
    pairs = [
        (question, documents[gold])
        for question, gold in zip(articles.questions, articles.gold, strict=True)
        if gold < TRAIN_ARTICLES
    ]
    held_out = [
        (qid, question, gold)
        for qid, question, gold in zip(articles.question_ids, articles.questions, articles.gold, strict=True)
        if gold >= TRAIN_ARTICLES
    ][::eval_every]
    corpus = {str(i): documents[i] for i in range(TRAIN_ARTICLES, len(documents))}
    return pairs, {
        "queries": {qid: question for qid, question, _ in held_out},
        "corpus": corpus,
        "relevant": {qid: {str(gold)} for qid, _, gold in held_out},
    }


def article_rows(pairs: list[tuple[str, str]], questions_per_article: int, seed: int) -> dict[str, list[Any]]:
    """Rows of ``questions_per_article`` questions of one article and the article, articles interleaved in
    a seeded order: one article's embedding (the costly part of a step) then serves that many questions
    instead of one. An article's last row is filled from its own shuffled questions again."""
    by_article: dict[str, list[str]] = {}
    for question, document in pairs:
        by_article.setdefault(document, []).append(question)
    documents = list(by_article)
    generator = random.Random(seed)
    rows: list[tuple[list[str], str, int]] = []
    for index, document in enumerate(documents):
        questions = by_article[document][:]
        generator.shuffle(questions)
        for start in range(0, len(questions), questions_per_article):
            chunk = questions[start : start + questions_per_article]
            chunk += questions[: questions_per_article - len(chunk)]
            rows.append((chunk, document, index))
    generator.shuffle(rows)
    columns: dict[str, list[Any]] = {
        f"question_{j}": [row[0][j] for row in rows] for j in range(questions_per_article)
    }
    columns["article"] = [row[1] for row in rows]
    columns["label"] = [row[2] for row in rows]
    return {"columns": columns, "documents": documents}


def article_retrieval_loss(model, documents: list[str], bank: bool, scale: float = 20.0):
    """Each question against the batch's articles (in-batch negatives, sentence-transformers' scaled
    cosine and cross-entropy), and with ``bank`` also against the last embedding of every other training
    article (no gradient through those): the held-out task is a choice among 24 articles, while 3 in-batch
    negatives gave a loss of 0.08 from the first step and little to learn from."""
    import torch
    from torch.nn.functional import cross_entropy, normalize

    class ArticleRetrievalLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.bank: torch.Tensor | None = None

        def _fill_bank(self) -> torch.Tensor:
            """The training articles' embeddings before the first step (counted as training time)."""
            with torch.no_grad():
                rows = [self.embed(self.model.preprocess([document])) for document in documents]
            return torch.cat(rows).detach()

        def embed(self, features) -> torch.Tensor:
            return normalize(self.model(features)["sentence_embedding"].float(), dim=-1)

        def forward(self, sentence_features, labels: torch.Tensor) -> torch.Tensor:
            *question_columns, article_column = list(sentence_features)
            articles = self.embed(article_column)
            questions = torch.cat([self.embed(column) for column in question_columns])
            targets = torch.arange(len(articles)).repeat(len(question_columns))
            candidates = articles
            if bank:
                if self.bank is None:
                    self.bank = self._fill_bank()
                others = torch.ones(len(self.bank), dtype=torch.bool)
                others[labels] = False
                candidates = torch.cat([articles, self.bank[others]])
                self.bank[labels] = articles.detach()
            return cross_entropy(scale * questions @ candidates.T, targets)

    return ArticleRetrievalLoss()


def build_model(folder: str | None, cache: str | None, attention_dropout: float):
    """The proxy as a SentenceTransformer (mean pooling, normalised), built once into the cache, with the
    attention dropout both runs train with."""
    from sentence_transformers import SentenceTransformer

    if folder is None:
        from bert_cluster.checkpoints import default_model_path
        from bert_cluster.evaluation.proxy import long_position_proxy

        folder = str(long_position_proxy(default_model_path(), 16384, cache=cache))
    config = {"attention_probs_dropout_prob": attention_dropout}
    return SentenceTransformer(folder, device="cpu", config_kwargs=config)


def prepare(model, variant: str, length: int, convert: dict[str, Any]):
    model.max_seq_length = length
    if variant == "clustered":
        import bert_cluster

        bert_cluster.convert(model[0].auto_model, **convert)
    return model


def score(model, held_out: dict[str, Any], batch_size: int) -> dict[str, float]:
    """R@1 and MRR@10 (x 100) of the held-out questions against the held-out articles."""
    import torch
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    evaluator = InformationRetrievalEvaluator(
        held_out["queries"],
        held_out["corpus"],
        held_out["relevant"],
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1],
        precision_recall_at_k=[1],
        map_at_k=[10],
        batch_size=batch_size,
        name="heldout",
        write_csv=False,
    )
    model.eval()
    with torch.inference_mode():
        metrics = evaluator(model)
    return {
        "R@1": 100 * metrics["heldout_cosine_recall@1"],
        "MRR@10": 100 * metrics["heldout_cosine_mrr@10"],
    }


def train(model, pairs, args, variant: str) -> dict[str, Any]:
    """Train until the last budget; keep the weights passed at each budget and the loss curve."""
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import PrinterCallback, TrainerCallback

    budgets = sorted(args.budgets)
    rows = article_rows(pairs, args.questions_per_article, args.seed)
    dataset = Dataset.from_dict(rows["columns"])
    snapshots: list[dict[str, Any]] = []
    curve: list[dict[str, float]] = []

    class Budget(TrainerCallback):
        """Training time only: the time spent here (copying weights) is taken off the clock."""

        def __init__(self) -> None:
            self.start = None
            self.paused = 0.0

        def elapsed(self) -> float:
            return time.perf_counter() - self.start - self.paused

        def on_train_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "loss" in logs:
                curve.append({"seconds": self.elapsed(), "step": state.global_step, "loss": logs["loss"]})

        def on_step_end(self, _args, state, control, **__):
            seconds = self.elapsed()
            pause = time.perf_counter()
            while len(snapshots) < len(budgets) and seconds >= budgets[len(snapshots)]:
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                budget = budgets[len(snapshots)]
                snapshots.append(
                    {"budget": budget, "seconds": seconds, "step": state.global_step, "weights": weights}
                )
                print(f"  {variant}: budget {snapshots[-1]['budget']:g} s passed at step {state.global_step}")
            self.paused += time.perf_counter() - pause
            if len(snapshots) == len(budgets):
                control.should_training_stop = True
            elif state.global_step % 10 == 0:  # the budget is the clock: what is left of it is the ETA
                loss = curve[-1]["loss"] if curve else float("nan")
                print(f"  {variant}: step {state.global_step}, {seconds:.0f}/{budgets[-1]:g} s of training, "
                      f"about {budgets[-1] - seconds:.0f} s left, loss {loss:.3f}")  # fmt: skip

    arguments = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.work) / variant),
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        num_train_epochs=args.max_epochs,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class Trainer(SentenceTransformerTrainer):
        def add_model_card_callback(self, *_, **__) -> None:
            """No model card: its dataset statistics tokenise every article again (half a short run)."""

    torch.manual_seed(args.seed)
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=dataset,
        loss=article_retrieval_loss(model, rows["documents"], bank=args.negatives == "bank"),
        callbacks=[Budget()],
    )
    trainer.remove_callback(PrinterCallback)  # the loss is in the curve and the progress lines
    trainer.train()
    return {"snapshots": snapshots, "curve": curve}


def score_copy(model, variant: str, held_out: dict[str, Any], args) -> dict[str, Any]:
    """A copy's scores with the attention it was trained with; with ``--score-exact-too`` the clustered
    copy's also with exact attention (``exact_attention``), which tells what its training learned from
    what its approximation costs at scoring."""
    scores: dict[str, Any] = score(model, held_out, args.eval_batch_size)
    if variant == "clustered" and args.score_exact_too:
        import bert_cluster

        encoder = model[0].auto_model
        bert_cluster.revert(encoder)
        try:
            scores["exact_attention"] = score(model, held_out, args.eval_batch_size)
        finally:
            bert_cluster.convert(encoder, **args.convert)
    return scores


def run_variant(variant: str, pairs, held_out, args) -> dict[str, Any]:
    model = build_model(args.minilm_16k, args.cache, args.attention_dropout)
    model = prepare(model, variant, args.length, args.convert)
    print(f"{variant}: scoring the untrained model")
    before = score_copy(model, variant, held_out, args)
    trained = train(model, pairs, args, variant)
    points = [{"budget": 0, "seconds": 0.0, "step": 0, **before}]
    for snapshot in trained["snapshots"]:
        model.load_state_dict(snapshot["weights"])
        points.append({key: snapshot[key] for key in ("budget", "seconds", "step")})
        points[-1].update(score_copy(model, variant, held_out, args))
        print(f"  {variant} at {snapshot['budget']:g} s: R@1 {points[-1]['R@1']:.1f}")
    unreached = [b for b in args.budgets if b not in {s["budget"] for s in trained["snapshots"]}]
    return {"points": points, "curve": trained["curve"], "unreached_budgets": unreached}


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
        "--questions-per-article", type=int, default=16, help="questions sharing one article's embedding"
    )
    parser.add_argument(
        "--negatives",
        choices=("in-batch", "bank"),
        default="in-batch",
        help="in-batch: the batch's other articles; bank: also every other training article's last embedding",
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
    for growth in ("cluster-growth", "topk-growth"):
        parser.add_argument(
            f"--{growth}",
            type=float,
            help=f"clustered run's {growth.replace('-', '_')}, how C or k grows past 512 tokens (default: "
            "convert's, 0.5)",
        )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--eval-every", type=int, default=1, help="score every n-th held-out question")
    parser.add_argument("--eval-batch-size", type=int, default=4)
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
        or min(args.eval_every, args.questions_per_article) < 1
    ):
        parser.error(
            "budgets must be positive, --length >= 2, --batch-size >= 2, --eval-every >= 1, "
            "--questions-per-article >= 1"
        )
    if not 0 <= args.attention_dropout < 1:
        parser.error(f"--attention-dropout must be in [0, 1), got {args.attention_dropout}")
    args.convert = {"backend": "cpu"}
    if args.clusters is not None:
        args.convert["clusters"] = args.clusters
    if args.mode is not None:
        args.convert["mode"] = args.mode
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
    pairs, held_out = split(load_articles(), args.eval_every, args.length)
    print(f"{len(pairs)} training pairs, {len(held_out['queries'])} held-out questions, "
          f"{len(held_out['corpus'])} held-out articles; budgets {args.budgets} s")  # fmt: skip
    load_before = load_average()
    variants = {variant: run_variant(variant, pairs, held_out, args) for variant in args.variants}
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
