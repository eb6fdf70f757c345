"""Fine-tune a checkpoint with clustered attention in the loop (``bert-cluster finetune``).

The model is converted first (every attention setting ``evaluate`` takes; ``exact=True`` leaves the
attention unmodified, the control), so the weights adapt to the approximation they will run with. It is
trained on the task's ``train:`` split (``configs/tasks``) with the head's own loss, through HF
``Trainer``: LoRA (peft) on the encoder's Linear layers with the head trained fully, or every weight;
checkpoints every ``save_steps`` under ``OUT/checkpoints`` and ``resume`` from the last complete one
(after Ctrl-C or ``kill -9``). ``OUT`` then holds a normal checkpoint, converted (LoRA merged), that
``bert-cluster evaluate OUT`` scores, and ``finetune.json`` / ``finetune.md`` / ``loss.png``: the
settings, the loss curve and the environment. ``distill`` mixes in (or, at 1, replaces the labels with) the
distance to the unmodified checkpoint's own outputs (``distillation``): the approximation is trained to give
what the exact attention gives, without training the task further.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bert_cluster import config as presets
from bert_cluster.checkpoints import attention_config, check_model_path, max_positions, quiet, resolve_model
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError, one_line, positive_int
from bert_cluster.evaluation.data import load_rows
from bert_cluster.evaluation.tasks import TaskConfig, get_tasks, label_mapping
from bert_cluster.finetuning import features, report
from bert_cluster.parallel import check_device

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
)
#: What a resume key was before it existed (a run started by an older version trained with it).
_RESUME_DEFAULTS = {"distill": 0.0, "distill_temperature": None, "distill_dropout": False}
#: The model class each loss trains (the head computes that loss from the features' labels).
_HEADS = {
    "cross-entropy": "AutoModelForSequenceClassification",
    "mse": "AutoModelForSequenceClassification",
    "span-cross-entropy": "AutoModelForQuestionAnswering",
}
DEFAULT_EPOCHS = 3.0
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
            "train_seconds": self.train_seconds,
        }


class FinetuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during training: ``checkpoint`` is the last complete one (None: none yet)."""

    def __init__(self, output: Path, checkpoint: Path | None) -> None:
        super().__init__(str(checkpoint))
        self.output, self.checkpoint = output, checkpoint


def last_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint under ``folder`` that was written to the end (its trainer_state.json last)."""
    if not folder.is_dir():
        return None
    steps = []
    for entry in folder.iterdir():
        number = entry.name.removeprefix("checkpoint-")
        if entry.is_dir() and entry.name.startswith("checkpoint-") and number.isdigit():
            steps.append((int(number), entry))
    complete = [(step, entry) for step, entry in steps if (entry / "trainer_state.json").is_file()]
    return max(complete)[1] if complete else None


def _number(name: str, value: Any, kind: type, allow_none: bool = True) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise UserError(f"{name} must be a positive {'number' if kind is float else 'int'}, got {value!r}")
    if not value > 0:
        raise UserError(f"{name} must be positive, got {value!r}")
    return kind(value)


def _train_task(name: str) -> TaskConfig:
    if not isinstance(name, str) or "," in name:
        raise UserError(f"finetune trains on one task, got {name!r}")
    (task,) = get_tasks(name)
    if task.train is None:
        trainable = sorted(t.name for t in _all_tasks() if t.train is not None)
        raise UserError(f"task {task.name} has no train split; tasks with one: {', '.join(trainable)}")
    if task.train.loss not in _HEADS:
        raise UserError(f"task {task.name}: finetune does not train the loss {task.train.loss!r}")
    regression = task.label_names is None
    if task.train.loss in ("cross-entropy", "mse") and (task.train.loss == "mse") != regression:
        raise UserError(
            f"task {task.name}: loss {task.train.loss} does not fit its labels "
            f"({'a regression' if regression else 'classes'}); use {'mse' if regression else 'cross-entropy'}"
        )
    return task


def _all_tasks() -> list[TaskConfig]:
    from bert_cluster.evaluation.tasks import load_tasks

    return list(load_tasks().values())


def _prepare_output(output: Path, settings: dict[str, Any], resume: bool, overwrite: bool) -> Path | None:
    """Check ``output`` for this run; the checkpoint to resume from (None: a fresh run).

    Raises:
        UserError: a non-empty folder without ``overwrite`` or ``resume``; ``resume`` with nothing to
            resume or with other settings than the run that made the checkpoints.
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
        return None
    check_output(output, True)
    found = last_checkpoint(checkpoints)
    if found is None:
        raise UserError(
            f"nothing to resume in {output}: no complete checkpoint under {checkpoints}; run without --resume"
        )
    try:
        earlier = json.loads((checkpoints / SETTINGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise UserError(f"cannot resume: {checkpoints / SETTINGS_FILE} is missing or unreadable") from None
    changed = [
        key for key in _RESUME_KEYS if earlier.get(key, _RESUME_DEFAULTS.get(key)) != settings.get(key)
    ]
    if changed:
        shown = ", ".join(f"{key} {earlier.get(key)!r} -> {settings.get(key)!r}" for key in changed)
        raise UserError(f"cannot resume with other settings than the run in {output} ({shown})")
    return found


def _load(source: str, task: TaskConfig) -> tuple[Any, Any, list[int] | None, bool]:
    """The model with the head ``task``'s loss trains, its tokenizer, the label mapping, the head's origin.

    The last is False where the checkpoint has no such head and the model got a fresh one.
    """
    import transformers

    auto_class = getattr(transformers, _HEADS[task.train.loss])
    try:
        with quiet():
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
            hf_config = transformers.AutoConfig.from_pretrained(source)
            has_head = any(
                name.endswith(auto_class.__name__.removeprefix("AutoModel"))
                for name in hf_config.architectures or []
            )
            extra: dict[str, Any] = {}
            if not has_head and task.train.loss != "span-cross-entropy":
                names = list(task.label_names or ["score"])
                extra = {
                    "num_labels": len(names),
                    "id2label": dict(enumerate(names)),
                    "label2id": {name: index for index, name in enumerate(names)},
                }
            model = auto_class.from_pretrained(source, **extra)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot load model {source}: {one_line(error)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"model {source}: a fast tokenizer (tokenizer.json) is needed")
    to_model = None
    if task.train.loss != "span-cross-entropy":
        model.config.problem_type = (
            "regression" if task.label_names is None else "single_label_classification"
        )
        mapping = label_mapping(model.config.id2label or {}, model.config.num_labels, task)
        if mapping is not None:  # model index -> dataset index; the labels need the inverse
            to_model = [mapping.index(index) for index in range(len(mapping))]
    return model, tokenizer, to_model, has_head


def _teacher(source: str, task: TaskConfig) -> Any:
    """The checkpoint with its original attention, for ``distill`` (reverted when it was saved converted)."""
    from bert_cluster import hf

    teacher, _, _, has_head = _load(source, task)
    if not has_head:
        raise UserError(
            f"--distill needs a checkpoint with its task head; {source} has none for {task.name} "
            "(fine-tune it on the labels first, without --distill)"
        )
    if isinstance(getattr(teacher.config, hf.SETTINGS_KEY, None), dict):
        hf.revert(teacher)
    return teacher


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
    lora: bool = True,
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
            every weight.
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
        reporter: progress callbacks (``evaluation.runner.Reporter``: start, task, configuration,
            advance, finish); None: silent.
        callbacks: further ``transformers.TrainerCallback`` objects.

    Raises:
        UserError: a mistake in the arguments, found before any training.
        FinetuneInterrupted: Ctrl-C; resume with ``resume=True``.
    """
    task_config = _train_task(task)
    lora_rank, lora_alpha = positive_int("lora_rank", lora_rank), positive_int("lora_alpha", lora_alpha)
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
        "epochs": epochs if max_steps is not None else (epochs or DEFAULT_EPOCHS),
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
    }
    if settings["max_steps"] is not None:
        settings["epochs"] = None
    resume_from = _prepare_output(output, settings, resume, overwrite)
    rows = load_rows(task_config, data_dir, split="train")
    chosen = rows.rows if limit is None else rows.rows[:limit]
    try:
        return _train(
            task_config,
            source,
            output,
            settings,
            config,
            chosen,
            rows.source,
            resume_from,
            reporter,
            callbacks,
        )
    except FinetuneInterrupted:
        raise
    except KeyboardInterrupt:  # before or after the training loop (loading, saving)
        raise FinetuneInterrupted(output, last_checkpoint(output / CHECKPOINTS)) from None


def _train(
    task: TaskConfig,
    source: str,
    output: Path,
    settings: dict[str, Any],
    config: ClusteredAttentionConfig | None,
    rows: list[dict[str, Any]],
    data_source: str,
    resume_from: Path | None,
    reporter: Any,
    callbacks: Sequence[Any],
) -> FinetuneResult:
    import transformers

    from bert_cluster import hf
    from bert_cluster.finetuning.progress import ProgressCallback, TrainingClock  # imports transformers

    # The teacher first, so that the new weights below are a run without distill's (the same seed's).
    teacher = _teacher(source, task) if settings["distill"] > 0 else None
    transformers.set_seed(settings["seed"])  # the new head's and LoRA's weights, before the Trainer's seed
    model, tokenizer, to_model, _ = _load(source, task)
    positions = max_positions(model.config)
    if positions is not None and settings["max_length"] > positions:
        raise UserError(
            f"--max-length {settings['max_length']} is more than model {source} takes ({positions})"
        )
    if task.train.loss == "span-cross-entropy":
        train = features.spans(rows, task, tokenizer, settings["max_length"])
    else:
        train = features.classification(rows, task, tokenizer, settings["max_length"], to_model)
    if config is not None:
        try:
            hf.convert(model, config=config)
        except (TypeError, ValueError) as error:
            raise UserError(f"cannot convert {source}: {one_line(error)}") from None
    if settings["lora"]:
        model = _lora(model, settings["lora_rank"], settings["lora_alpha"])
    checkpoints = output / CHECKPOINTS
    if resume_from is None:  # an earlier run's (--overwrite; checked to be one): never resumed into this one
        for entry in checkpoints.glob("checkpoint-*"):
            shutil.rmtree(entry)
    for entry in checkpoints.glob("checkpoint-*") if resume_from is not None else ():
        if entry.is_dir() and not (entry / "trainer_state.json").is_file():
            shutil.rmtree(entry)  # half written when the earlier run was killed
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    try:
        arguments = transformers.TrainingArguments(
            output_dir=str(checkpoints),
            per_device_train_batch_size=settings["batch_size"],
            learning_rate=settings["learning_rate"],
            num_train_epochs=settings["epochs"] or 1.0,
            max_steps=settings["max_steps"] or -1,
            seed=settings["seed"],
            data_seed=settings["seed"],
            bf16=settings["bf16"],
            logging_strategy="steps",
            logging_steps=1,
            save_strategy="steps",
            save_steps=settings["save_steps"],
            save_total_limit=2,
            report_to=[],
            disable_tqdm=True,
            use_cpu=settings["device"] == "cpu",
            dataloader_num_workers=0,
        )
    except (ValueError, ImportError) as error:  # bf16 on hardware without it, for one
        raise UserError(f"cannot train with these settings: {one_line(error)}") from None
    label = "exact attention" if config is None else f"{config.mode}, C={config.clusters}"
    label = f"{label}, {'LoRA' if settings['lora'] else 'full'}"
    if teacher is not None:
        label = f"{label}, distilled {settings['distill']:g}{' with dropout' * settings['distill_dropout']}"
    label = f"fine-tuning ({label})"
    clock = TrainingClock.resuming(resume_from)
    progress = [ProgressCallback(reporter, task.name, label)] if reporter is not None else []
    extra = [*callbacks, clock, *progress]
    common = {
        "model": model,
        "args": arguments,
        "train_dataset": train,
        "data_collator": transformers.DataCollatorWithPadding(tokenizer),
        "callbacks": extra,
    }
    if teacher is None:
        trainer = transformers.Trainer(**common)
    else:
        from bert_cluster.finetuning.distillation import DistillationTrainer  # imports transformers

        trainer = DistillationTrainer(
            **common,
            teacher=teacher,
            weight=settings["distill"],
            temperature=settings["distill_temperature"],
            loss=task.train.loss,
            dropout=settings["distill_dropout"],
        )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its dicts on stdout: the report
    try:
        with quiet():
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except KeyboardInterrupt:
        raise FinetuneInterrupted(output, last_checkpoint(checkpoints)) from None
    trained = trainer.model
    if settings["lora"]:
        trained = trained.merge_and_unload()
    try:
        with quiet():
            trained.save_pretrained(output)
            tokenizer.save_pretrained(output)
    except OSError as error:
        raise UserError(f"cannot write the checkpoint to {output}: {error.strerror or error}") from None
    curve = [
        {key: entry[key] for key in ("step", "epoch", "loss", "learning_rate", "grad_norm") if key in entry}
        for entry in trainer.state.log_history
        if "loss" in entry
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
    )
    result.files = report.write(result, output)
    return result
