"""What clustered attention costs the long-document retrieval of scripts/long_document_training.py before any
training, per convert setting: held-out R@1 of the untrained MiniLM-16k proxy, on the training split too.

The question the training runs left open (issue 40, item 3): the clustered run starts 0.2-0.3 R@1 below the
exact one; is that a cost a larger C or k removes, or scatter of the size the training differences have?
Each setting converts the proxy, embeds the 24 training and the 24 held-out articles at ``--length``
tokens, and scores each split's questions against its articles (R@1 x 100, the training script's split and
cut). Questions are embedded once, unmodified: convert's ``min_length="auto"`` keeps rows that short exact
(checked on the first 64 questions of each setting). Also the mean cosine of the article embeddings to
exact, the questions each setting gains and loses against exact (a net change of a few questions can be
the balance of many flips), and the seconds of one training article's forward and backward (the costly
part of a step).

    python scripts/long_document_fidelity.py --minilm-16k OUT/minilm-l6-16k \\
        --settings defaults cluster_growth=0.75 cluster_growth=1 topk_growth=0.75 \\
        --output docs/results/long_document_training_zen1/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_long_context import environment  # noqa: E402
from long_document_training import TRAIN_ARTICLES, build_model, load_articles, split  # noqa: E402

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


def splits(length: int) -> dict[str, dict[str, Any]]:
    """Each split's questions, its 24 articles and the index of each question's article."""
    articles = load_articles()
    pairs, held_out = split(articles, 1, length)
    documents = list(dict.fromkeys(document for _, document in pairs))
    corpus = list(held_out["corpus"])
    return {
        "training": {
            "questions": [question for question, _ in pairs],
            "articles": documents,
            "gold": [documents.index(document) for _, document in pairs],
        },
        "held_out": {
            "questions": list(held_out["queries"].values()),
            "articles": [held_out["corpus"][c] for c in corpus],
            "gold": [corpus.index(next(iter(r))) for r in held_out["relevant"].values()],
        },
    }


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
    from bert_cluster.environment import cpu_name

    torch.set_num_threads(args.threads)
    data = splits(args.length)
    model = build_model(args.minilm_16k, None, 0.0)
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
        "settings": {"length": args.length, "threads": args.threads, "train_articles": TRAIN_ARTICLES},
        "data": {name: {"questions": len(part["questions"])} for name, part in data.items()},
        "rows": rows,
        "environment": {
            **environment(args.threads),
            "processor": cpu_name(),
            "kernels_cpu_isa": bert_cluster.info().get("kernels_cpu_isa"),
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
