"""How close fine-tuned models are to their checkpoint's own predictions (issue 40: distillation's measure).

Accuracy on a small dev set moves by whole examples (RTE: 0.36 points each), so a recovery table alone
cannot show what a distilled model was trained for: to give at C what the checkpoint gives unmodified.
This measures that directly on a classification task's dev split: for the checkpoint and each model in
``--work`` (the folders ``benchmarks.finetune_recovery`` fine-tuned), scored at each ``--clusters`` C
(i-clustered+, every row approximated, hash seed 0) and unmodified, the mean KL divergence from the
checkpoint's unmodified class distribution to the model's, and the share of examples whose predicted class
is the checkpoint's.

    python -m benchmarks.prediction_agreement --checkpoint OUT/minilm-l6-rte --task rte \\
        --work WORK --data-dir ../shared/data --output agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import bert_cluster
from bert_cluster.reports import atomic_write, environment
from bert_cluster.tasks.config import get_tasks
from bert_cluster.tasks.data import load_rows


def log_probabilities(model, tokenizer, rows, fields, max_length: int, batch: int = 16) -> torch.Tensor:
    """The model's log class probabilities for every row, in order."""
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            texts = [[str(row[field]) for row in chunk] for field in fields]
            encoded = tokenizer(
                *texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt"
            )
            out.append(model(**encoded).logits.float().log_softmax(-1))
    return torch.cat(out)


def load(path: Path, clusters: int | None):
    """The model in ``path`` with its original attention (reverted if saved converted), converted at C."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    if hasattr(model.config, "clustered_attention"):
        bert_cluster.revert(model)
    if clusters is not None:
        bert_cluster.convert(model, clusters=clusters, min_length=0, seed=0)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument(
        "--work", type=Path, required=True, help="benchmarks.finetune_recovery's --work folder"
    )
    parser.add_argument("--clusters", type=int, nargs="+", default=[10])
    parser.add_argument("--max-length", type=int, default=None, help="default: the task's, as evaluate")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.output.exists():
        raise SystemExit(f"{args.output} exists; choose another --output")
    from transformers import AutoTokenizer

    (task,) = get_tasks(args.task)
    args.max_length = args.max_length or task.max_length
    rows = load_rows(task, args.data_dir).rows
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    fields = task.text_fields
    teacher = log_probabilities(load(args.checkpoint, None), tokenizer, rows, fields, args.max_length)
    models = {"checkpoint": args.checkpoint}
    for folder in sorted(args.work.glob(f"{args.task}-*-seed*")):
        if (folder / "finetune.json").is_file():
            models[folder.name] = folder
    settings = [None, *args.clusters]
    results: dict[str, dict] = {}
    for name, path in models.items():
        results[name] = {}
        for clusters in settings:
            scored = log_probabilities(load(path, clusters), tokenizer, rows, fields, args.max_length)
            kl = (teacher.exp() * (teacher - scored)).sum(-1)
            agree = (teacher.argmax(-1) == scored.argmax(-1)).float()
            column = "unmodified" if clusters is None else f"C={clusters}"
            results[name][column] = {
                "kl_mean": float(kl.mean()),
                "kl_median": float(kl.median()),
                "kl_max": float(kl.max()),
                "agreement": float(agree.mean() * 100),
            }
            print(name, column, results[name][column], flush=True)
    arms: dict[str, dict] = {}
    for name, columns in results.items():
        arm = name.split("-seed")[0] if name != "checkpoint" else name
        for column, values in columns.items():
            for key, value in values.items():
                arms.setdefault(arm, {}).setdefault(column, {}).setdefault(key, []).append(value)
    summary = {
        arm: {
            column: {key: statistics.mean(values) for key, values in measures.items()}
            for column, measures in columns.items()
        }
        for arm, columns in arms.items()
    }
    document = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "examples": len(rows),
        "models": results,
        "mean_over_seeds": summary,
        "environment": environment(),
    }
    atomic_write(args.output, lambda path: Path(path).write_text(json.dumps(document, indent=2) + "\n"))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
