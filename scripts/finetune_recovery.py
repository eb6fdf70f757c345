"""Recovery at small C (issue 40, item 2): fine-tune with clustered attention at C = 10, score at 10 and 25.

For each task and seed: the checkpoint as it is, the checkpoint fine-tuned with i-clustered+ at the
training C in the loop, and the control (the same fine-tuning with exact attention), each scored
unmodified and at every scoring C (hash seed 0) on the task's dev split (SQuAD: ``squad-half``, the
held-out articles 25-48). The target: the clustered fine-tuning at C = 10 within ``--target`` points of
the original checkpoint's unmodified score.

    python scripts/finetune_recovery.py --models OUT --tasks rte --seeds 1 --data-dir ../shared/data \\
        --work /tmp/recovery --output recovery.json

``--models``: the folder ``../shared/models/build.py OUT`` wrote (minilm-l6-rte, -mrpc, -squad).

The results file is written after every step (the checkpoint's scores, then each fine-tuning and its
scores), so a run longer than a sitting (SQuAD: about 50 minutes per fine-tuning and its scoring on 2
cores) is done in parts: the same command with ``--resume`` keeps what the file holds, continues an
interrupted fine-tuning from its last checkpoint in ``--work`` (one every ``--save-steps``), and may ask
for more ``--seeds``. Without ``--resume`` an existing results file is refused, not replaced.

Each fine-tuned arm also records ``displacement``: the L2 norm of its weights' change from the checkpoint
(encoder, where LoRA's merged product lands, and head), so a control is seen to move as far as the arm it
controls. With ``--distill 1`` the exact arm starts at its teacher and barely moves; ``exact-dropout`` (exact
attention, the student's dropout on) is the control that moves: dropout is its perturbation where the
clustered arm's is the approximation. ``--score-seeds 0 1 2`` scores every C with each hash seed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import bert_cluster
from bert_cluster.finetuning import CHECKPOINTS, default_learning_rate, last_checkpoint
from bert_cluster.reports import atomic_write, environment

CHECKPOINT = {
    "rte": "minilm-l6-rte",
    "mrpc": "minilm-l6-mrpc",
    "stsb": "minilm-l6-stsb",
    "squad-half": "minilm-l6-squad",
}


def score_key(clusters: int | None, seed: int | None, seeds: list[int]) -> str:
    """``unmodified``, ``C=10`` (hash seed 0 alone, as the first results files have it) or ``C=10 seed=1``."""
    if clusters is None:
        return "unmodified"
    return f"C={clusters}" if seeds == [0] else f"C={clusters} seed={seed}"


def scores(model: Path, task: str, clusters: list[int], args) -> dict:
    """Unmodified and per-C scores of ``model`` on ``task`` (each hash seed), with the time it took."""
    began = time.monotonic()
    seeds = args.score_seeds
    results = bert_cluster.evaluate(
        str(model), task, clusters, seeds=seeds, data_dir=args.data_dir, limit=args.limit
    )
    (result,) = results.tasks
    if not result.ok:
        raise SystemExit(f"{task}: {result.error}")
    runs = {score_key(run.clusters, run.seed, seeds): run.scores for run in result.runs}
    return {
        "scores": runs,
        "examples": result.examples,
        "seconds": round(time.monotonic() - began, 1),
        "notes": result.notes,  # a checkpoint saved converted: "saved converted", scored unmodified reverted
    }


def rescore_needed(name: str, run: dict) -> bool:
    """A clustered arm scored before evaluate reverted a checkpoint saved converted (2026-12-05): its
    "unmodified" score is the saved C's, so it is scored again while its fine-tuning is still in --work."""
    return name == "clustered" and "notes" not in run


def displacement(original: Path, trained: Path) -> dict:
    """L2 norms of the weights' change from ``original`` to ``trained``: encoder, head, and all together."""
    before, after = (load_file(str(folder / "model.safetensors")) for folder in (original, trained))
    if set(before) != set(after):
        raise SystemExit(f"{trained} and {original} hold other weights: {sorted(set(before) ^ set(after))}")
    squares = {"encoder": 0.0, "head": 0.0}
    for name, weight in before.items():
        part = "head" if name.split(".")[0] not in ("bert", "roberta", "model") else "encoder"
        squares[part] += float(torch.sum((after[name].double() - weight.double()) ** 2))
    return {**{part: sum_**0.5 for part, sum_ in squares.items()}, "all": sum(squares.values()) ** 0.5}


#: Settings that may change between the parts of one results file (where the parts run, and how many seeds).
PART_SETTINGS = ("seeds", "resume", "work", "output", "save_steps", "arms")
#: Each arm's fine-tuning: exact attention or not, and the student's dropout on under --distill.
ARMS = {
    "clustered": {"exact": False, "distill_dropout": False},
    "exact": {"exact": True, "distill_dropout": False},
    "exact-dropout": {"exact": True, "distill_dropout": True},
}
#: Settings added since the first results files, as those runs had them.
NEWER_SETTINGS = {"distill": 0.0, "distill_temperature": 1.0, "score_seeds": [0]}


def fine_tune(original: Path, task: str, out: Path, arm: str, seed: int, args) -> dict:
    """One arm's fine-tuning: kept when ``out`` holds a finished one with these settings, continued from its
    last checkpoint when it was interrupted (``--resume``), else run from the start."""
    exact = ARMS[arm]["exact"]
    options = {
        **ARMS[arm],
        "seed": seed,
        "attention": None if exact else {"clusters": args.train_clusters},
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "max_length": args.max_length,
        "distill": args.distill,
        "distill_temperature": args.distill_temperature,
    }
    report = out / "finetune.json"
    if args.resume and report.is_file():
        done = json.loads(report.read_text(encoding="utf-8"))
        expected = {
            "exact": exact,
            "seed": seed,
            "batch_size": args.batch_size,
            "max_steps": args.max_steps,
            "epochs": args.epochs if args.max_steps is None else None,
            "learning_rate": args.learning_rate or default_learning_rate(True, args.distill),
            "max_length": args.max_length,
            "distill": args.distill,
            "distill_dropout": ARMS[arm]["distill_dropout"],
        }
        if not exact:
            expected["clusters"] = args.train_clusters
        found = {
            "distill": 0.0,
            "distill_dropout": False,
            **done["settings"],
            "clusters": (done["settings"].get("attention") or {}).get("clusters"),
        }
        differ = {key: (found.get(key), value) for key, value in expected.items() if found.get(key) != value}
        if differ:
            raise SystemExit(f"{out} holds a fine-tuning with other settings {differ}; move it")
        print(task, seed, arm, "fine-tuned already in", out, flush=True)
        return {key: done[key] for key in ("steps", "train_seconds", "loss_curve")}
    resume = args.resume and last_checkpoint(out / CHECKPOINTS) is not None
    trained = bert_cluster.finetune(
        original, task, out, resume=resume, overwrite=not resume, data_dir=args.data_dir,
        save_steps=args.save_steps, **options,
    )  # fmt: skip
    return {"steps": trained.steps, "train_seconds": trained.train_seconds, "loss_curve": trained.loss_curve}


def resumed(args, settings: dict) -> dict:
    """The results file to continue (``--resume``), checked to be this command's; else a new document."""
    if not args.output.exists():
        if args.resume:
            raise SystemExit(f"--resume: {args.output} does not exist; run without --resume to start it")
        return {"settings": settings, "environment": environment(), "tasks": {}}
    if not args.resume:
        raise SystemExit(f"{args.output} exists: --resume to continue it, or choose another --output")
    document = json.loads(args.output.read_text(encoding="utf-8"))
    earlier = {**NEWER_SETTINGS, **document["settings"]}
    earlier = {k: v for k, v in earlier.items() if k not in PART_SETTINGS}
    now = {k: v for k, v in settings.items() if k not in PART_SETTINGS}
    if earlier != now:
        changed = {k: (earlier.get(k), now.get(k)) for k in earlier | now if earlier.get(k) != now.get(k)}
        raise SystemExit(f"--resume: {args.output} was made with other settings: {changed}")
    document["settings"]["seeds"] = max(document["settings"]["seeds"], args.seeds)
    document.setdefault("parts", []).append(environment())
    return document


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=["rte"], choices=sorted(CHECKPOINT))
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--train-clusters", type=int, default=10)
    parser.add_argument("--score-clusters", type=int, nargs="+", default=[10, 25])
    parser.add_argument(
        "--score-seeds", type=int, nargs="+", default=[0], help="the hash seeds each C is scored with"
    )
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--limit", type=int, default=None, help="score the first N dev examples")
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument(
        "--distill",
        type=float,
        default=0.0,
        help="both arms: weight of the distance to the checkpoint's own outputs (finetune's distill)",
    )
    parser.add_argument("--distill-temperature", type=float, default=1.0)
    parser.add_argument(
        "--arms",
        nargs="+",
        default=["clustered", "exact"],
        choices=list(ARMS),
        help="the arms to run in this part (with --distill 1 the exact arm starts at its teacher: distance "
        "0, gradients of float rounding only, which Adam still scales to steps of the learning rate; "
        "exact-dropout, with --distill only: the student's dropout on, the control that moves)",
    )
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--save-steps", type=int, default=50, help="a fine-tuning checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="continue the results file in --output")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.epochs is None and args.max_steps is None:
        args.epochs = 1.0
    if "exact-dropout" in args.arms and not args.distill:
        parser.error("the arm exact-dropout needs --distill (fine-tuning on the labels has its dropout on)")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = resumed(args, settings)

    def save() -> None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.output, lambda path: Path(path).write_text(json.dumps(document, indent=2) + "\n"))

    for task in args.tasks:
        original = args.models / CHECKPOINT[task]
        entry = document["tasks"].get(task)
        if entry is None:
            before = scores(original, task, args.score_clusters, args)
            entry = document["tasks"][task] = {"checkpoint": str(original), "original": before, "seeds": {}}
            save()
        print(task, "original", entry["original"]["scores"], flush=True)
        for seed in range(args.seeds):
            runs = entry["seeds"].setdefault(str(seed), {})
            for name in ARMS:
                if name not in args.arms:
                    continue
                out = args.work / f"{task}-{name}-seed{seed}"
                if name in runs and rescore_needed(name, runs[name]) and (out / "finetune.json").is_file():
                    runs[name].update(scores(out, task, args.score_clusters, args))
                    print(
                        task,
                        seed,
                        name,
                        "scored again (unmodified reverted)",
                        runs[name]["scores"],
                        flush=True,
                    )
                    save()
                if name in runs:
                    continue
                trained = fine_tune(original, task, out, name, seed, args)
                runs[name] = {
                    "steps": trained["steps"],
                    "train_seconds": round(trained["train_seconds"], 1),
                    "final_loss": trained["loss_curve"][-1]["loss"] if trained["loss_curve"] else None,
                    "displacement": displacement(original, out),
                    **scores(out, task, args.score_clusters, args),
                }
                print(task, seed, name, runs[name], flush=True)
                save()
    print(json.dumps(document["tasks"], indent=2))


if __name__ == "__main__":
    main()
