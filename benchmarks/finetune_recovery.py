"""Recovery at small C (issue 40, item 2): fine-tune with clustered attention at C = 10, score at 10 and 25.

For each task and seed: the checkpoint as it is, the checkpoint fine-tuned with i-clustered+ at the
training C in the loop, and the control (the same fine-tuning with exact attention), each scored
unmodified and at every scoring C (hash seed 0) on the task's dev split (SQuAD: ``squad-half``, the
held-out articles 25-48). The target: the clustered fine-tuning at C = 10 within ``--target`` points of
the original checkpoint's unmodified score.

    python -m benchmarks.finetune_recovery --models OUT --tasks rte --seeds 1 --data-dir ../shared/data \\
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
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

import bert_cluster
from benchmarks.harness import (
    mean_std,
    mean_std_plain,
    runs,
    signed,
    table_lines,
)
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


# --- tables (benchmarks.render) ----------------------------------------------------------------------

RECOVERY_METRICS = {"accuracy": "acc", "f1": "F1", "exact_match": "EM", "pearson": "Pearson"}


#: The arms in the order shown: the adapted one, then its controls.
RECOVERY_ARMS = {
    "clustered": "{trained}, C = {c} in the loop",
    "exact": "control: {trained}, exact",
    "exact-dropout": "control: {trained}, exact, dropout on",
}


def hashed(scores: dict, column: str, metric: str) -> list[float]:
    """A column's score under each hash seed: ``C=10`` (hash seed 0 alone) or ``C=10 seed=S`` for each S."""
    if column in scores:
        return [scores[column][metric]]
    return [value[metric] for key, value in scores.items() if key.startswith(f"{column} seed=")]


def target_cell(cell: str, values: list[float], floor: float) -> str:
    """``cell`` bold where the mean of ``values`` meets ``floor``, else ", missed"; with several seeds, how
    many of them meet it."""
    met = statistics.mean(values) >= floor
    marked = f"**{cell}**" if met else f"{cell}, missed"
    if len(values) < 2:
        return marked
    return f"{marked} ({sum(value >= floor for value in values)}/{len(values)} seeds)"


def recovery_table(results: list[dict], headline: Sequence[str] = ()) -> list[str]:
    """Per task and metric: the checkpoint, the fine-tuning with clustered attention in the loop and its
    controls (the same fine-tuning with exact attention; ``exact-dropout`` with the student's dropout on),
    each scored unmodified and at each C; over seeds the mean ± sample std (a seed's score: the mean over
    its hash seeds). The target, the training C within ``target`` points of the checkpoint's unmodified
    score, is marked in every row where it holds (bold), the checkpoint's and the controls' included; a
    paired row per control gives the clustered run minus that control, seed by seed. ``headline``: show
    only each task's first metric found in it (default every metric)."""
    settings = results[0]["settings"]
    train_c, target = settings["train_clusters"], settings["target"]
    distill = settings.get("distill", 0.0)  # results files from before the option: 0
    trained = "distilled" if distill == 1 else "fine-tuned"
    columns = ["unmodified", *(f"C={c}" for c in settings["score_clusters"])]
    trained_column = f"C={train_c}"
    score_seeds = {tuple(result["settings"].get("score_seeds", [0])) for result in results}
    several_hashes = any(len(seeds) > 1 for seeds in score_seeds)
    arms_found = [arm for arm in RECOVERY_ARMS if any(arm in seed for seed in all_recovery_seeds(results))]
    moved = any("displacement" in run for seed in all_recovery_seeds(results) for run in seed.values())
    rows = []
    unreverted = paired = False

    def extra(hash_spread: str, displacement: str) -> list[str]:
        return [hash_spread] * several_hashes + [displacement] * moved

    for result in results:
        for task, entry in result["tasks"].items():
            original = entry["original"]["scores"]
            seeds = list(entry["seeds"].values())
            found = [metric for metric in headline if metric in original["unmodified"]][:1]
            for metric in found or original["unmodified"]:
                base = original["unmodified"][metric]
                label = RECOVERY_METRICS.get(metric, metric)
                row = [task, label, "checkpoint"]
                for column in columns:
                    value = statistics.mean(hashed(original, column, metric))
                    cell = f"{value:.2f}" + ("" if column == "unmodified" else f" ({value - base:+.2f})")
                    row.append(
                        target_cell(cell, [value], base - target) if column == trained_column else cell
                    )
                spread = hashed(original, trained_column, metric)
                rows.append(row + extra(f"{statistics.stdev(spread):.2f}" if len(spread) > 1 else "", "0"))
                # Each seed's score per arm and column (the mean over its hash seeds); None: not scored.
                per_seed: dict[str, dict[str, list[float | None]]] = {}
                for arm in arms_found:
                    done = [seed[arm] for seed in seeds if arm in seed]  # a run in parts: some arms to come
                    if not done:
                        continue
                    name = RECOVERY_ARMS[arm].format(trained=trained, c=train_c)
                    row = [task, label, f"{name} ({runs(len(done)).replace('run', 'seed')})"]
                    per_seed[arm] = {}
                    for column in columns:
                        per_seed[arm][column] = [
                            recovery_score(seed.get(arm), arm, column, metric) for seed in seeds
                        ]  # aligned with the seeds, for the paired rows
                        scored = [value for value in per_seed[arm][column] if value is not None]
                        if len(scored) < len(done):
                            unreverted = True
                        if not scored:
                            row.append("–")
                            continue
                        mean = statistics.mean(scored)
                        spread = f" ± {statistics.stdev(scored):.2f}" if len(scored) > 1 else ""
                        cell = f"{mean:.2f}{spread} ({mean - base:+.2f})"
                        row.append(
                            target_cell(cell, scored, base - target) if column == trained_column else cell
                        )
                    hash_spreads = [
                        statistics.stdev(values)
                        for run in done
                        if len(values := hashed(run["scores"], trained_column, metric)) > 1
                    ]
                    distances = [run["displacement"]["all"] for run in done if "displacement" in run]
                    rows.append(
                        row
                        + extra(
                            f"{statistics.mean(hash_spreads):.2f}" if hash_spreads else "",
                            mean_std_plain(distances) if distances else "–",
                        )
                    )
                for control in (arm for arm in arms_found if arm != "clustered"):
                    if "clustered" not in per_seed or control not in per_seed:
                        continue
                    paired = True
                    row = [task, label, f"paired: C = {train_c} in the loop − {control}, per seed"]
                    for column in columns:
                        pairs = zip(per_seed["clustered"][column], per_seed[control][column], strict=True)
                        differences = [a - b for a, b in pairs if a is not None and b is not None]
                        each = ", ".join(signed(value) for value in differences)
                        row.append(f"{mean_std(differences)} ({each})" if differences else "–")
                    rows.append(row + extra("", ""))
    header = ["task", "metric", "model", "unmodified", *(f"C = {c}" for c in settings["score_clusters"])]
    header += [f"hash seeds' std, C = {train_c}"] * several_hashes + ["weights moved (L2)"] * moved
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
    hashes = "; ".join(
        "hash seed 0"
        if seeds == (0,)
        else f"hash seeds {', '.join(map(str, seeds))} (a seed's score: their mean)"
        for seeds in sorted(score_seeds)
    )
    caption = (
        f"Scores on each task's dev split (SQuAD: held-out articles 25-48), i-clustered+, {hashes}; "
        "change against the checkpoint's unmodified score in brackets. Fine-tuning: LoRA (rank 16, every "
        f"encoder Linear) and the task head, {schedule} ({per_task}), batch {settings['batch_size']}, "
        f"learning rate {rate}, {seed_text}; target: C = {train_c} within {target:g} of the "
        f"checkpoint's unmodified score, marked in every row where it holds (bold: the mean meets it; "
        f"k/n: the seeds that do). {cpus}; {dates[0] if len(dates) == 1 else f'{dates[0]} to {dates[-1]}'}."
    )
    if paired:
        caption += (
            f" Paired: the C = {train_c} arm minus the control, seed by seed, mean ± sample std (each "
            "seed's difference in brackets)."
        )
    if moved:
        caption += (
            " Weights moved: the L2 norm of the change of every weight from the checkpoint (LoRA's merged "
            "product and the head), mean ± std over seeds."
        )
    if distill > 0:
        towards = (
            "the distance to the checkpoint's own outputs alone (labels unused)"
            if distill == 1
            else f"the task loss and, at weight {distill:g}, the distance to the checkpoint's own outputs"
        )
        dropout = (
            "no dropout in the teacher; in the student only in the control with dropout on"
            if "exact-dropout" in arms_found
            else "no dropout in either model"
        )
        caption += (
            f" Loss: {towards}, the teacher the checkpoint with exact attention, KL at temperature "
            f"{settings.get('distill_temperature', 1.0):g}, {dropout} (`--distill`)."
        )
    if any(recovery_partial(result) for result in results):
        caption += (
            " **Partial**: runs still to come; each row counts the seeds it holds of the "
            f"{seeds_asked} asked."
        )
    if unreverted:
        caption += " " + UNREVERTED
    return table_lines(header, "lll" + "r" * (len(header) - 3), rows) + ["", caption]


def recovery_score(run: dict | None, arm: str, column: str, metric: str) -> float | None:
    """One seed's score in one arm and column, the mean over its hash seeds; None: not run or, for a
    clustered arm's unmodified column scored before the revert fix, not known (``UNREVERTED``)."""
    if run is None or (arm == "clustered" and column == "unmodified" and "notes" not in run):
        return None
    return statistics.mean(hashed(run["scores"], column, metric))


def recovery_partial(result: dict) -> bool:
    """A results file with runs to come: fewer seeds than asked, or a seed without an arm that was asked for
    (``--arms``: the first part's) or that another seed has (a later part's)."""
    asked = result["settings"].get("arms", ["clustered", "exact"])
    for entry in result["tasks"].values():
        seeds = list(entry["seeds"].values())
        arms = set(asked).union(*seeds)
        if len(seeds) < result["settings"].get("seeds", 0) or any(set(seed) != arms for seed in seeds):
            return True
    return False


def all_recovery_seeds(results: list[dict]) -> list[dict]:
    """Every seed's arms, over the files and their tasks."""
    return [
        seed for result in results for entry in result["tasks"].values() for seed in entry["seeds"].values()
    ]


#: Why a clustered arm's unmodified cell leaves out runs (or shows –): they were scored before evaluate
#: reverted a checkpoint saved converted, so their "unmodified" score was the saved C = 10's.
UNREVERTED = (
    "Unmodified, clustered arm: only runs scored since 2026-12-05 (–: none); before, `evaluate` scored a "
    'checkpoint saved converted with its saved settings as "unmodified", so those runs\' cell was the '
    "C = 10 model's (their C = 10 and C = 25 cells are right)."
)


if __name__ == "__main__":
    main()
