"""Recovery at small C (issue 40, item 2): fine-tune with clustered attention at C = 10, score at 10 and 25.

For each task and seed: the checkpoint as it is, the checkpoint fine-tuned with i-clustered+ at the
training C in the loop, and the control (the same fine-tuning with exact attention), each scored
unmodified and at every scoring C (hash seed 0) on the task's dev split (SQuAD: ``squad-half``, the
held-out articles 25-48). The target: the clustered fine-tuning at C = 10 within ``--target`` points of
the original checkpoint's unmodified score.

    python scripts/finetune_recovery.py --models OUT --tasks rte --seeds 1 --data-dir ../shared/data \\
        --work /tmp/recovery --output recovery.json

``--models``: the folder ``../shared/models/build.py OUT`` wrote (minilm-l6-rte, -mrpc, -squad).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bert_cluster
from bert_cluster.reports import atomic_write, environment

CHECKPOINT = {
    "rte": "minilm-l6-rte",
    "mrpc": "minilm-l6-mrpc",
    "stsb": "minilm-l6-stsb",
    "squad-half": "minilm-l6-squad",
}


def scores(model: Path, task: str, clusters: list[int], data_dir: str, limit: int | None) -> dict:
    """Unmodified and per-C scores of ``model`` on ``task`` (hash seed 0), with the time it took."""
    began = time.monotonic()
    results = bert_cluster.evaluate(str(model), task, clusters, seeds=[0], data_dir=data_dir, limit=limit)
    (result,) = results.tasks
    if not result.ok:
        raise SystemExit(f"{task}: {result.error}")
    runs = {"unmodified" if run.clusters is None else f"C={run.clusters}": run.scores for run in result.runs}
    return {"scores": runs, "examples": result.examples, "seconds": round(time.monotonic() - began, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=["rte"], choices=sorted(CHECKPOINT))
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--train-clusters", type=int, default=10)
    parser.add_argument("--score-clusters", type=int, nargs="+", default=[10, 25])
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--limit", type=int, default=None, help="score the first N dev examples")
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    if args.epochs is None and args.max_steps is None:
        args.epochs = 1.0
    document: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                      "environment": environment(), "tasks": {}}  # fmt: skip
    for task in args.tasks:
        original = args.models / CHECKPOINT[task]
        before = scores(original, task, args.score_clusters, args.data_dir, args.limit)
        entry = {"checkpoint": str(original), "original": before, "seeds": {}}
        print(task, "original", entry["original"]["scores"], flush=True)
        for seed in range(args.seeds):
            runs = {}
            for name, exact in (("clustered", False), ("exact", True)):
                out = args.work / f"{task}-{name}-seed{seed}"
                trained = bert_cluster.finetune(
                    original, task, out, exact=exact, seed=seed, overwrite=True, data_dir=args.data_dir,
                    attention=None if exact else {"clusters": args.train_clusters}, epochs=args.epochs,
                    max_steps=args.max_steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                    max_length=args.max_length,
                )  # fmt: skip
                runs[name] = {
                    "steps": trained.steps,
                    "train_seconds": round(trained.train_seconds, 1),
                    "final_loss": trained.loss_curve[-1]["loss"] if trained.loss_curve else None,
                    **scores(out, task, args.score_clusters, args.data_dir, args.limit),
                }
                print(task, seed, name, runs[name], flush=True)
            entry["seeds"][seed] = runs
        document["tasks"][task] = entry
        args.output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.output, lambda path: Path(path).write_text(json.dumps(document, indent=2) + "\n"))
    print(json.dumps(document["tasks"], indent=2))


if __name__ == "__main__":
    main()
