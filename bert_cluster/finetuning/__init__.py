"""Fine-tune a checkpoint with clustered attention in the loop (``bert-cluster finetune``).

The model is converted first (every attention setting ``evaluate`` takes; ``exact=True`` leaves the
attention unmodified, the control), so the weights adapt to the approximation they will run with. It is
trained on the task's ``train:`` split (``configs/tasks``) with the head's own loss, through HF
``Trainer``: LoRA (peft) on the encoder's Linear layers with the head trained fully, or every weight;
checkpoints every ``save_steps`` under ``OUT/checkpoints`` and ``resume`` from the newest intact one
(after Ctrl-C or ``kill -9``; a damaged one is skipped and named). ``OUT`` then holds a normal
checkpoint, converted (LoRA merged), that ``bert-cluster evaluate OUT`` scores, and ``finetune.json`` /
``finetune.md`` / ``loss.png``: the settings, the loss curve and the environment. Nothing ends silently
wrong (``safety``): non-finite settings are refused, a non-finite loss or gradient norm stops the run with
nothing saved as final, a resume checks that the training data and the model's weights are the ones the
run began with, and an output folder that is, holds or lies inside the model's is refused. ``distill``
mixes in (or, at 1, replaces the labels with) the distance to the unmodified checkpoint's own outputs
(``distillation``): the approximation is trained to give what the exact attention gives, without
training the task further.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bert_cluster import config as presets
from bert_cluster.checkpoints import (
    attention_config,
    check_apart,
    check_model_path,
    max_positions,
    quiet,
    resolve_model,
)
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError, one_line, positive_int
from bert_cluster.finetuning import report, safety
from bert_cluster.parallel import check_device
from bert_cluster.tasks import TaskConfig, get_tasks, load_rows, load_tasks
from bert_cluster.tasks.data import locator
from bert_cluster.tasks.kinds import Examples, ScoreSettings, TrainableKind, TrainingModel, trainable

__all__ = ["FinetuneInterrupted", "FinetuneResult", "finetune"]

#: Where the Trainer's checkpoints go, inside the output folder.
CHECKPOINTS = "checkpoints"
#: The settings of the run that made the checkpoints: ``resume`` refuses to continue with others.
SETTINGS_FILE = "finetune-settings.json"
#: The settings that change what is trained (the others, such as the device, may differ on resume).
_RESUME_KEYS = (
    "model",
    "task",
    "attention",
    "lora",
    "lora_rank",
    "lora_alpha",
    "epochs",
    "max_steps",
    "learning_rate",
    "batch_size",
    "seed",
    "bf16",
    "max_length",
    "limit",
    "distill",
    "distill_temperature",
    "distill_dropout",
    "attention_dropout",
    "max_seconds",
    "warmup_steps",
    "schedule",
)
#: What a resume key was before it existed (a run started by an older version trained with it).
_RESUME_DEFAULTS = {
    "distill": 0.0,
    "distill_temperature": None,
    "distill_dropout": False,
    "attention_dropout": None,
    "max_seconds": None,
    "warmup_steps": 0,
    "schedule": "linear",
}
#: Learning-rate schedules after the warm-up: Trainer's linear decay to 0 at the last step, or constant
#: (what a time budget needs: its last step is not known in advance).
SCHEDULES = {"linear": "linear", "constant": "constant_with_warmup"}
DEFAULT_EPOCHS = 3.0
#: Passes over the data a time budget may take without epochs or max_steps: a bound the budget ends first.
UNBOUNDED_EPOCHS = 10_000.0
DEFAULT_LEARNING_RATE = {True: 5e-4, False: 2e-5}  # LoRA (as ../shared/models was trained), full
#: LoRA's default with ``distill``: 5e-4 overshoots a distance that starts small (RTE at C = 10, 40 steps:
#: the dev KL to the teacher 0.0122 -> 0.0179 at 5e-4, -> 0.0077 at 1e-4).
DISTILL_LEARNING_RATE = 1e-4


def default_learning_rate(lora: bool, distill: float) -> float:
    """The learning rate when none is given."""
    return DISTILL_LEARNING_RATE if lora and distill > 0 else DEFAULT_LEARNING_RATE[lora]


@dataclasses.dataclass
class FinetuneResult:
    """What a run wrote: the checkpoint folder, its report and the loss curve."""

    output: Path
    settings: dict[str, Any]
    loss_curve: list[dict[str, float]]
    steps: int
    examples: int
    features: int
    source: str
    resumed_from: str | None
    train_seconds: float  # over every part of a resumed run (progress.TrainingClock)
    files: dict[str, Path]
    #: Damaged checkpoints a resume passed over, newest first (name: why).
    skipped_checkpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    #: ``resume`` found the run finished: nothing was trained or written (the result is its report's).
    already_finished: bool = False
    #: The held-out split scored at each ``eval_at`` mark: ``{mark, seconds, step, scores}``.
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The training time at each step of the loss curve (``{step, seconds}``; a resumed run's steps
    #: before its checkpoint as they were logged then, when the checkpoint holds them).
    clock_curve: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``finetune.json`` without its environment)."""
        return {
            "output": str(self.output),
            "settings": self.settings,
            "loss_curve": self.loss_curve,
            "steps": self.steps,
            "examples": self.examples,
            "features": self.features,
            "source": self.source,
            "resumed_from": self.resumed_from,
            "skipped_checkpoints": self.skipped_checkpoints,
            "train_seconds": self.train_seconds,
            "evaluations": self.evaluations,
            "clock_curve": self.clock_curve,
        }

    @classmethod
    def finished(cls, output: Path, document: dict[str, Any]) -> FinetuneResult:
        """The result a finished run's ``finetune.json`` records (``already_finished``)."""
        keys = ("settings", "loss_curve", "steps", "examples", "features", "source", "resumed_from")
        return cls(
            output=output,
            **{key: document[key] for key in keys},
            train_seconds=document["train_seconds"],
            files={name: output / name for name in document.get("files", [])},
            skipped_checkpoints=document.get("skipped_checkpoints", {}),
            already_finished=True,
            evaluations=document.get("evaluations", []),
            clock_curve=document.get("clock_curve", []),
        )


class FinetuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during training: ``checkpoint`` is the last complete one (None: none yet)."""

    def __init__(self, output: Path, checkpoint: Path | None) -> None:
        super().__init__(str(checkpoint))
        self.output, self.checkpoint = output, checkpoint


def last_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint under ``folder`` that was written to the end (its trainer_state.json last).

    Its files are not checked: ``safety.newest_intact`` is the one a resume starts from.
    """
    return next(iter(safety.checkpoints(folder)), None)


def _number(name: str, value: Any, kind: type, allow_none: bool = True) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise UserError(f"{name} must be a positive {'number' if kind is float else 'int'}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # inf would train every weight to NaN
        raise UserError(f"{name} must be a finite positive number, got {value!r}")
    if not value > 0:
        raise UserError(f"{name} must be positive, got {value!r}")
    return kind(value)


def _train_task(name: str) -> tuple[TaskConfig, TrainableKind]:
    """The task ``finetune`` trains on and its kind (which loads the model and makes the features)."""
    if not isinstance(name, str) or "," in name:
        raise UserError(f"finetune trains on one task, got {name!r}")
    (task,) = get_tasks(name)
    if task.train is None:
        trainable_tasks = sorted(t.name for t in load_tasks().values() if t.train is not None)
        raise UserError(f"task {task.name} has no train split; tasks with one: {', '.join(trainable_tasks)}")
    return task, trainable(task)


@dataclasses.dataclass
class _Start:
    """Where a run starts: fresh, from a checkpoint, or already finished."""

    checkpoint: Path | None = None
    #: The settings of the run resumed (its hashes of the data and the weights among them).
    earlier: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Damaged checkpoints passed over, newest first (name: why): removed before training.
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The finished run's ``finetune.json``.
    finished: dict[str, Any] | None = None


def _prepare_output(output: Path, settings: dict[str, Any], resume: bool, overwrite: bool) -> _Start:
    """Check ``output`` for this run: where it starts.

    Raises:
        UserError: a non-empty folder without ``overwrite`` or ``resume``; ``resume`` with nothing to
            resume (or every checkpoint damaged) or with other settings than the run that made the
            checkpoints.
    """
    from bert_cluster.reports import check_output

    if resume and overwrite:
        raise UserError("give --resume (continue the run in OUT) or --overwrite (start it again), not both")
    checkpoints = output / CHECKPOINTS
    if not resume:
        try:
            check_output(output, overwrite)
        except UserError as error:
            if last_checkpoint(checkpoints) is None:
                raise
            raise UserError(f"{error}; or --resume to continue its run") from None
        if checkpoints.exists() and not (checkpoints / SETTINGS_FILE).is_file():
            raise UserError(
                f"{checkpoints} is not a finetune run's checkpoints folder; move it or choose another OUT"
            )
        return _Start()
    check_output(output, True)
    finished = _finished_report(output)
    if finished is not None:  # the report is written last: the run is done, nothing is left to train
        _check_same_settings(finished["settings"], settings, output)
        return _Start(earlier=finished["settings"], finished=finished)
    found, skipped = safety.newest_intact(checkpoints)
    if found is None:
        damaged = "; ".join(f"{name}: {why}" for name, why in skipped.items())
        raise UserError(
            f"nothing to resume in {output}: "
            + (f"every checkpoint is damaged ({damaged}); start again with --overwrite" if skipped else
               f"no complete checkpoint under {checkpoints}; run without --resume")
        )  # fmt: skip
    try:
        earlier = json.loads((checkpoints / SETTINGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise UserError(f"cannot resume: {checkpoints / SETTINGS_FILE} is missing or unreadable") from None
    _check_same_settings(earlier, settings, output)
    return _Start(checkpoint=found, earlier=earlier, skipped=skipped)


def _finished_report(output: Path) -> dict[str, Any] | None:
    """The ``finetune.json`` of a run that finished in ``output``, or None."""
    try:
        document = json.loads((output / report.FILES.json).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or not isinstance(document.get("settings"), dict):
        return None
    return document


def _mark(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise UserError(f"each eval_at mark must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _check_same_settings(earlier: dict[str, Any], settings: dict[str, Any], output: Path) -> None:
    changed = [
        key for key in _RESUME_KEYS if earlier.get(key, _RESUME_DEFAULTS.get(key)) != settings.get(key)
    ]
    if changed:
        shown = ", ".join(f"{key} {earlier.get(key)!r} -> {settings.get(key)!r}" for key in changed)
        raise UserError(f"cannot resume with other settings than the run in {output} ({shown})")


def _check_same_content(earlier: dict[str, Any], settings: dict[str, Any], key: str, what: str) -> None:
    """Refuse a resume whose data or weights (``key``'s hash) differ from the run's (where it has them)."""
    before, now = earlier.get(key), settings[key]
    if before is not None and before != now:
        raise UserError(
            f"cannot resume: {what} changed since the run began (sha256 {before[:12]}... then, {now[:12]}... "
            "now); give the same, or start again with --overwrite"
        )


def _teacher(source: str, task: TaskConfig) -> Any:
    """The checkpoint with its original attention, for ``distill`` (reverted when it was saved converted)."""
    from bert_cluster import hf

    teacher = trainable(task).training_model(source, task)
    if not teacher.has_head:
        raise UserError(
            f"--distill needs a checkpoint with its task head; {source} has none for {task.name} "
            "(fine-tune it on the labels first, without --distill)"
        )
    model = teacher.model
    if isinstance(getattr(model.config, hf.SETTINGS_KEY, None), dict):
        hf.revert(model)
    return model


def _lora(model: Any, rank: int, alpha: int) -> Any:
    """LoRA on every Linear layer of the encoder; the task head (and nothing else) trained fully."""
    try:
        import peft
    except ImportError:
        raise UserError(
            "LoRA needs peft: pip install 'bert-cluster[finetune]' (or pip install peft), or pass --full"
        ) from None
    import torch

    prefix = model.base_model_prefix
    encoder = getattr(model, prefix)
    targets = [
        f"{prefix}.{name}" for name, module in encoder.named_modules() if isinstance(module, torch.nn.Linear)
    ]
    heads = [
        name
        for name, child in model.named_children()
        if name != prefix and any(True for _ in child.parameters())
    ]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, modules_to_save=heads)
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` (transformers 5.x warns).
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return peft.get_peft_model(model, config)


def finetune(
    model: str | Path,
    task: str,
    output: str | Path,
    *,
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None = None,
    exact: bool = False,
    lora: bool | None = None,
    lora_rank: int = 16,
    lora_alpha: int = 32,
    epochs: float | None = None,
    max_steps: int | None = None,
    learning_rate: float | None = None,
    batch_size: int = 16,
    seed: int = 0,
    bf16: bool = False,
    save_steps: int = 500,
    resume: bool = False,
    overwrite: bool = False,
    data_dir: str | Path | Sequence[str | Path] | None = None,
    max_length: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    distill: float = 0.0,
    distill_temperature: float = 1.0,
    distill_dropout: bool = False,
    attention_dropout: float | None = None,
    max_seconds: float | None = None,
    eval_at: Sequence[float] = (),
    eval_limit: int | None = None,
    eval_exact: bool = False,
    warmup_steps: int = 0,
    schedule: str | None = None,
    reporter: Any = None,
    callbacks: Sequence[Any] = (),
) -> FinetuneResult:
    """Fine-tune ``model`` on ``task``'s train split with clustered attention in the loop; save to ``output``.

    Args:
        model: hub id, local folder or ``package:NAME``; a checkpoint without the task's head gets a new one.
        task: one task with a ``train:`` split (``bert-cluster ls``).
        output: folder for the fine-tuned checkpoint, its report and ``checkpoints/``; empty unless
            ``overwrite`` (start again) or ``resume`` (continue from the last complete checkpoint).
        attention: the clustered-attention settings, over the evaluator's preset (every row approximated);
            a ``ClusteredAttentionConfig`` or a mapping of the settings to change.
        exact: train with the unmodified attention (the control); no ``attention`` then.
        lora: LoRA (peft, rank ``lora_rank``, alpha ``lora_alpha``) with the head trained fully; False:
            every weight; None: the task kind's way (LoRA where it trains a head, every weight where LoRA
            does not suit it: long-document retrieval).
        epochs: passes over the train split (default 3); ``max_steps`` instead: optimizer steps.
        learning_rate: default 5e-4 with LoRA (1e-4 with ``distill``), 2e-5 without.
        batch_size: examples (SQuAD: windows) per step.
        seed: data order, new weights (head, LoRA) and dropout; also the hash planes' seed unless
            ``attention`` sets one.
        bf16: bf16 autocast (``Trainer``'s ``bf16``).
        save_steps: a checkpoint every N steps under ``output/checkpoints`` (the last two kept).
        data_dir: folder(s) holding the task's train file (searched one level down too).
        max_length: truncation length (default the task's).
        limit: train on the first N rows of the split.
        device: ``cpu`` or ``cuda[:N]``.
        distill: weight in [0, 1] of the distance to the checkpoint's own outputs with its original
            attention (frozen, the teacher) in the loss, ``(1 - distill) * task loss + distill * distance``;
            1 trains towards the teacher alone (``distillation``). The checkpoint must have the task's head.
        distill_temperature: the softmax temperature of that distance for classes and spans.
        distill_dropout: keep the student's dropout on under ``distill`` (off by default): the noise that
            moves an exact-attention control as the approximation moves the clustered run.
        attention_dropout: the model's attention dropout while training (None: its config's); 0 keeps
            torch's SDPA on its flash kernel (with dropout it falls back to the math path, which keeps
            every N x N probability for the backward).
        max_seconds: a budget of training time (scoring excluded): training stops at the first step past
            it (``epochs``, ``max_steps`` bound it too; without them it runs until the budget).
        eval_at: marks of training time (seconds; 0 = before the first step) at which the task's
            held-out split is scored with the model as it trains (its own attention), the clock paused:
            ``FinetuneResult.evaluations``.
        eval_limit: score N held-out examples at each mark (the kind's sample, as ``evaluate --limit``).
        eval_exact: at each mark, also score the converted model with exact attention.
        warmup_steps: steps of linear learning-rate warm-up.
        schedule: the learning rate after the warm-up, ``linear`` (down to 0 at the last step) or
            ``constant``; default ``constant`` with ``max_seconds`` (the last step is not known), else
            ``linear``.
        reporter: progress callbacks (``evaluation.runner.Reporter``: start, task, configuration,
            advance, finish); None: silent.
        callbacks: further ``transformers.TrainerCallback`` objects.

    Raises:
        UserError: a mistake in the arguments, found before any training.
        FinetuneInterrupted: Ctrl-C; resume with ``resume=True``.
    """
    task_config, kind = _train_task(task)
    lora_rank, lora_alpha = positive_int("lora_rank", lora_rank), positive_int("lora_alpha", lora_alpha)
    if lora is None:
        lora = kind.lora
    elif lora and not kind.lora:
        raise UserError(f"task {task_config.name} ({task_config.kind}) trains every weight: no LoRA (--full)")
    batch_size, save_steps = positive_int("batch_size", batch_size), positive_int("save_steps", save_steps)
    epochs = _number("epochs", epochs, float)
    max_steps = _number("max_steps", max_steps, int)
    learning_rate = _number("learning_rate", learning_rate, float)
    max_length = _number("max_length", max_length, int)
    limit = _number("limit", limit, int)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"seed must be a non-negative int, got {seed!r}")
    if isinstance(distill, bool) or not isinstance(distill, (int, float)) or not 0 <= distill <= 1:
        raise UserError(
            f"distill must be a number from 0 to 1 (the distillation loss's weight), got {distill!r}"
        )
    distill_temperature = _number("distill_temperature", distill_temperature, float, allow_none=False)
    if distill_dropout and not distill:
        raise UserError("distill_dropout needs distill > 0 (fine-tuning on the labels has its dropout on)")
    if epochs is not None and max_steps is not None:
        raise UserError("give epochs or max_steps, not both")
    if distill and not kind.distillable:
        raise UserError(f"task {task_config.name} ({task_config.kind}) cannot be distilled: give no distill")
    if attention_dropout is not None and (
        isinstance(attention_dropout, bool)
        or not isinstance(attention_dropout, (int, float))
        or not 0 <= attention_dropout < 1
    ):
        raise UserError(f"attention_dropout must be a number in [0, 1), got {attention_dropout!r}")
    max_seconds = _number("max_seconds", max_seconds, float)
    marks = sorted({_mark(mark) for mark in eval_at})
    eval_limit = _number("eval_limit", eval_limit, int)
    if marks and getattr(kind, "scoring_model", None) is None:
        raise UserError(
            f"task {task_config.name} ({task_config.kind}) is not scored while it trains: no eval_at"
        )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise UserError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
    schedule = schedule or ("constant" if max_seconds is not None else "linear")
    if schedule not in SCHEDULES:
        raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if exact and attention:
        raise UserError("exact trains with the unmodified attention: give no attention settings with it")
    config = None
    if not exact:
        given = attention if attention is not None else {}
        if isinstance(given, Mapping) and "seed" not in given:
            given = {**given, "seed": seed}
        config = attention_config(given, {}, presets.EVALUATION_SETTINGS)
    device = check_device(device)
    source = check_model_path(resolve_model(model))
    output = Path(output).expanduser()
    check_apart(source, output)
    settings = {
        "model": source,
        "task": task_config.name,
        "task_version": task_config.version,
        "loss": task_config.train.loss,
        "attention": None if config is None else config.to_dict(),
        "exact": exact,
        "lora": lora,
        "lora_rank": lora_rank if lora else None,
        "lora_alpha": lora_alpha if lora else None,
        "epochs": epochs if max_steps is not None or max_seconds is not None else (epochs or DEFAULT_EPOCHS),
        "max_steps": max_steps,
        "learning_rate": learning_rate or default_learning_rate(lora, distill),
        "batch_size": batch_size,
        "seed": seed,
        "bf16": bf16,
        "save_steps": save_steps,
        "max_length": max_length or task_config.max_length,
        "limit": limit,
        "device": device,
        "distill": float(distill),
        "distill_temperature": distill_temperature if distill > 0 else None,
        "distill_dropout": bool(distill_dropout),
        "attention_dropout": None if attention_dropout is None else float(attention_dropout),
        "max_seconds": max_seconds,
        "eval_at": marks,
        "eval_limit": eval_limit,
        "eval_exact": bool(eval_exact),
        "warmup_steps": warmup_steps,
        "schedule": schedule,
    }
    if settings["max_steps"] is not None:
        settings["epochs"] = None
    start = _prepare_output(output, settings, resume, overwrite)
    if start.finished is not None:  # nothing is trained, nothing written
        return FinetuneResult.finished(output, start.finished)
    rows = load_rows(task_config, data_dir, split="train")
    chosen = rows.rows if limit is None else rows.rows[:limit]
    kind.check_rows(chosen, task_config, locator(task_config, data_dir, rows.source, len(rows.rows)))
    held_out = None
    if marks:  # read before any training: a missing held-out split is found now
        folders = [data_dir] if isinstance(data_dir, (str, Path)) else data_dir
        held_out = kind.load_examples(task_config, list(folders) if folders else None, eval_limit)
    settings["data_sha256"] = safety.rows_sha256(chosen)
    _check_same_content(start.earlier, settings, "data_sha256", f"the training data ({rows.source})")
    try:
        return _train(
            task_config,
            kind,
            source,
            output,
            settings,
            config,
            chosen,
            rows.source,
            start,
            reporter,
            callbacks,
            held_out,
        )
    except FinetuneInterrupted:
        raise
    except KeyboardInterrupt:  # before or after the training loop (loading, saving)
        raise FinetuneInterrupted(output, last_checkpoint(output / CHECKPOINTS)) from None


def _train(
    task: TaskConfig,
    kind: TrainableKind,
    source: str,
    output: Path,
    settings: dict[str, Any],
    config: ClusteredAttentionConfig | None,
    rows: list[dict[str, Any]],
    data_source: str,
    start: _Start,
    reporter: Any,
    callbacks: Sequence[Any],
    held_out: Examples | None = None,
) -> FinetuneResult:
    import transformers

    from bert_cluster import hf
    from bert_cluster.finetuning.progress import (  # imports transformers
        CheckpointChecksums,
        FiniteGuard,
        ProgressCallback,
        StopAtTheEnd,
        TrainingClock,
        TrainingMarks,
    )

    # The teacher first, so that the new weights below are a run without distill's (the same seed's).
    teacher = _teacher(source, task) if settings["distill"] > 0 else None
    transformers.set_seed(settings["seed"])  # the new head's and LoRA's weights, before the Trainer's seed
    overrides = (
        {}
        if settings["attention_dropout"] is None
        else {"attention_probs_dropout_prob": settings["attention_dropout"]}
    )
    loaded: TrainingModel = kind.training_model(source, task, overrides)
    model, tokenizer = loaded.model, loaded.tokenizer
    settings["model_sha256"] = safety.weights_sha256(model, loaded.fresh)  # as loaded: before any change
    _check_same_content(start.earlier, settings, "model_sha256", f"the model's weights ({source})")
    positions = max_positions(loaded.target.config)
    if positions is not None and settings["max_length"] > positions:
        raise UserError(
            f"--max-length {settings['max_length']} is more than model {source} takes ({positions})"
        )
    loaded.max_length, loaded.seed = settings["max_length"], settings["seed"]
    train = kind.training_features(rows, task, loaded)
    if config is not None:
        try:
            hf.convert(loaded.target, config=config)
        except (TypeError, ValueError) as error:
            raise UserError(f"cannot convert {source}: {one_line(error)}") from None
    if settings["lora"]:
        model = _lora(model, settings["lora_rank"], settings["lora_alpha"])
    checkpoints = output / CHECKPOINTS
    resume_from = start.checkpoint
    if resume_from is None:  # an earlier run's (--overwrite; checked to be one): never resumed into this one
        for entry in checkpoints.glob("checkpoint-*"):
            shutil.rmtree(entry)
    for entry in checkpoints.glob("checkpoint-*") if resume_from is not None else ():
        half_written = entry.is_dir() and not (entry / safety.STATE).is_file()  # the earlier run killed
        if half_written or entry.name in start.skipped:  # damaged: named in the result, trained again
            shutil.rmtree(entry)
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    arguments = {
        "output_dir": str(checkpoints),
        "per_device_train_batch_size": settings["batch_size"],
        "learning_rate": settings["learning_rate"],
        "num_train_epochs": settings["epochs"] or (UNBOUNDED_EPOCHS if settings["max_seconds"] else 1.0),
        "warmup_steps": settings["warmup_steps"],
        "lr_scheduler_type": SCHEDULES[settings["schedule"]],
        "max_steps": settings["max_steps"] or -1,
        "seed": settings["seed"],
        "data_seed": settings["seed"],
        "bf16": settings["bf16"],
        "logging_strategy": "steps",
        "logging_steps": 1,
        "logging_nan_inf_filter": False,  # the loss logged is the step's own, NaN included (FiniteGuard)
        "save_strategy": "steps",
        "save_steps": settings["save_steps"],
        "save_total_limit": 2,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": settings["device"] == "cpu",
        "dataloader_num_workers": 0,
    }
    label = "exact attention" if config is None else f"{config.mode}, C={config.clusters}"
    label = f"{label}, {'LoRA' if settings['lora'] else 'full'}"
    if teacher is not None:
        label = f"{label}, distilled {settings['distill']:g}{' with dropout' * settings['distill_dropout']}"
    label = f"fine-tuning ({label})"
    clock = TrainingClock.resuming(resume_from)
    guard, at_the_end = FiniteGuard(), StopAtTheEnd()
    marks = TrainingMarks(
        clock,
        settings["eval_at"],
        settings["max_seconds"],
        _scorer(kind, task, loaded, held_out, settings, config) if held_out is not None else dict,
        TrainingMarks.saved(resume_from),
    )
    budget = None if settings["max_seconds"] is None else (clock, settings["max_seconds"])
    progress = [ProgressCallback(reporter, task.name, label, budget)] if reporter is not None else []
    extra = [at_the_end, *callbacks, clock, marks, guard, CheckpointChecksums(), *progress]
    distilling: dict[str, Any] = {}
    if teacher is not None:
        from bert_cluster.finetuning.distillation import DistillationTrainer  # imports transformers

        distilling = {
            "trainer_class": DistillationTrainer,
            "teacher": teacher,
            "weight": settings["distill"],
            "temperature": settings["distill_temperature"],
            "loss": task.train.loss,
            "dropout": settings["distill_dropout"],
        }
    loaded.model = model  # wrapped in LoRA
    try:
        trainer = kind.trainer(loaded, train, {"arguments": arguments, "callbacks": extra, **distilling})
    except (ValueError, ImportError) as error:  # bf16 on hardware without it, for one
        raise UserError(f"cannot train with these settings: {one_line(error)}") from None
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its dicts on stdout: the report
    try:
        with quiet():
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except StopAtTheEnd.Stop:  # the checkpoint is the run's last step: the model as it holds it
        pass
    except KeyboardInterrupt:
        raise FinetuneInterrupted(output, last_checkpoint(checkpoints)) from None
    if guard.stopped is not None:
        step, what = guard.stopped
        last = safety.newest_intact(checkpoints)[0]
        kept = f"the last good checkpoint, {last.name}, is kept" if last else "no checkpoint was saved before"
        raise UserError(
            f"training stopped at step {step}: {what}; nothing was saved as the final model and {kept}; "
            f"lower --learning-rate (it was {settings['learning_rate']:g}) and start again with --overwrite"
        )
    trained = trainer.model
    if settings["lora"]:
        trained = trained.merge_and_unload()
    _check_finite(trained, output)
    try:
        with quiet():
            kind.save(trained, tokenizer, output)
    except OSError as error:
        raise UserError(f"cannot write the checkpoint to {output}: {error.strerror or error}") from None
    curve = [
        {key: entry[key] for key in ("step", "epoch", "loss", "learning_rate", "grad_norm") if key in entry}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    clock_curve = [
        {"step": entry["step"], "seconds": entry["seconds"]}
        for entry in trainer.state.log_history
        if "loss" in entry and "seconds" in entry
    ]
    result = FinetuneResult(
        output=output,
        settings=settings,
        loss_curve=curve,
        steps=trainer.state.global_step,
        examples=len(rows),
        features=len(train),
        source=data_source,
        resumed_from=None if resume_from is None else resume_from.name,
        train_seconds=clock.seconds,
        files={},
        skipped_checkpoints=start.skipped,
        evaluations=marks.evaluations,
        clock_curve=clock_curve,
    )
    result.files = report.write(result, output)
    return result


def _scorer(
    kind: TrainableKind,
    task: TaskConfig,
    loaded: TrainingModel,
    held_out: Examples,
    settings: dict[str, Any],
    config: ClusteredAttentionConfig | None,
) -> Any:
    """What ``TrainingMarks`` calls at each mark: the kind's scores of the model as it trains.

    With ``eval_exact`` a converted model is also scored with its attention reverted (``exact_attention``):
    what its training learned, apart from what its approximation costs at scoring.
    """
    from bert_cluster import hf

    scoring = kind.scoring_model(loaded)  # type: ignore[attr-defined]
    options = ScoreSettings(
        batch_size=task.batch_size, max_length=settings["max_length"], device=settings["device"]
    )

    def scores() -> dict[str, float]:
        loaded.model.eval()
        values = kind.score(scoring, task, held_out, options, lambda *progress: None)  # type: ignore[attr-defined]
        return {name: float(value) for name, value in values.items()}

    def score() -> dict[str, Any]:
        entry: dict[str, Any] = {"scores": scores()}
        if settings["eval_exact"] and config is not None:
            hf.revert(loaded.target)
            try:
                entry["exact_attention"] = scores()
            finally:
                hf.convert(loaded.target, config=config)
        return entry

    return score


def _check_finite(model: Any, output: Path) -> None:
    """Refuse to save a model with a non-finite weight (nothing is written)."""
    import torch

    bad = [name for name, tensor in model.state_dict().items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise UserError(
            f"the trained model has non-finite weights ({shown}): nothing was saved to {output}; lower "
            "--learning-rate and start again with --overwrite"
        )
