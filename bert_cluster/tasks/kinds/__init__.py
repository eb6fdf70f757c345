"""Task kinds: how a family of tasks loads its model and data and scores one configuration.

The runner knows nothing about classification, SQuAD or sentence embeddings: it looks ``task.kind`` up in
``KINDS``, loads the model and the examples once, then scores the unmodified model and every patched
configuration through the same ``score``, calling ``bert_cluster.convert`` / ``revert`` on
``LoadedModel.patched`` in between.

Adding a kind: write a module in this package with a class that has the ``TaskKind`` members, register
an instance with ``register_kind`` at the bottom of the module, and import the module at the bottom of
this file (the registry holds objects, never module names). ``score`` runs its model passes through
``settings.map(function, items, lengths, advance)``: that is what shards the batches across processes,
times them (speed beside the scores) and gathers the outputs; a kind that runs its own loop still works,
timed as a whole and in every process. Optional: ``positions(task, checkpoint_positions)``, the positions
of the model the kind really scores when it derives one from the checkpoint (``evaluate`` checks
``--max-length`` against it before any work).

A kind that can be trained (``bert-cluster finetune``) also has the ``TrainableKind`` members: the
``train.loss`` values it trains, its model loaded for training (through ``bert_cluster.checkpoints``, the
one way every model is loaded), the check of its training rows, its training features and the Trainer
that trains on them, and how the trained model is saved. ``HeadTraining`` gives the members that kinds
training a transformers head share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from bert_cluster.errors import UserError
from bert_cluster.parallel import Progress, Workers


@dataclasses.dataclass
class LoadedModel:
    """A model ready to score.

    Attributes:
        model: what the kind runs (a transformers model, or a SentenceTransformer).
        tokenizer: its tokenizer.
        patched: the module ``bert_cluster.convert`` patches (None: ``model`` itself).
        max_positions: the longest input the model takes (checked against ``--max-length``).
        extra: whatever else the kind keeps (label map, cached encodings).
    """

    model: Any
    tokenizer: Any
    patched: torch.nn.Module | None = None
    max_positions: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def target(self) -> torch.nn.Module:
        """The module to convert and revert."""
        return self.patched if self.patched is not None else self.model


@dataclasses.dataclass
class Examples:
    """A task's evaluation examples and the file they were read from (named in the report)."""

    items: Any
    source: str
    count: int
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. a retrieval corpus size


@dataclasses.dataclass
class ScoreSettings:
    """Per-run settings every kind honours, and the batch loop its model passes go through."""

    batch_size: int = 32
    max_length: int | None = None  # None: the task's default
    device: str = "cpu"
    workers: Workers = dataclasses.field(default_factory=Workers)

    def map(
        self,
        function: Callable[[list[Any]], Sequence[Any]],
        items: Sequence[Any],
        lengths: Sequence[int],
        advance: Progress | None = None,
    ) -> list[Any]:
        """``function`` over this run's batches of ``items`` (see ``Workers.map``): outputs in item order."""
        return self.workers.map(function, items, lengths, self.batch_size, advance)


class TaskKind(Protocol):
    """What a kind provides. ``task`` is a ``bert_cluster.tasks.config.TaskConfig``."""

    name: str

    def check(self, task: Any) -> None:
        """Raise ``UserError`` if the task's fields, options or metric names do not suit this kind."""
        ...

    def load_model(self, model: str | Path, task: Any, device: str) -> LoadedModel:
        """Load ``model`` (hub id or folder) with the head the task needs; check the head fits."""
        ...

    def load_examples(self, task: Any, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """Read the task's dev examples (local files first, the hub when reachable); ``limit`` of them."""
        ...

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """Run the (possibly patched) model over the examples and return metric name -> value."""
        ...


@dataclasses.dataclass
class TrainingModel:
    """A model ready to train, as a kind loads it for ``finetune``.

    Attributes:
        model: what the Trainer trains; its forward computes the loss from the features' labels.
        tokenizer: its tokenizer (saved beside the trained model).
        source: the checkpoint (or model config) it came from.
        has_head: the checkpoint held the task's head (False: the head is fresh).
        fresh: the weights the checkpoint did not hold (left out of the weights' hash).
        patched: the module ``bert_cluster.convert`` patches (None: ``model`` itself).
        extra: whatever else the kind keeps (the label mapping).
        max_length: the run's length in tokens, the features' truncation or window.
        seed: the run's seed (data order, fresh weights, masks).
    """

    model: Any
    tokenizer: Any
    source: str
    has_head: bool = True
    fresh: list[str] = dataclasses.field(default_factory=list)
    patched: torch.nn.Module | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_length: int = 512
    seed: int = 0

    @property
    def target(self) -> torch.nn.Module:
        """The module to convert."""
        return self.patched if self.patched is not None else self.model


#: Where a training row (its index among the rows read, and the row) came from, for a message.
Locator = Callable[[int, dict[str, Any]], str]


class TrainableKind(Protocol):
    """What a kind that ``finetune`` trains provides, besides the ``TaskKind`` members."""

    #: The ``train.loss`` values it trains; ``lora``: whether LoRA suits its model (the default then);
    #: ``distillable``: whether ``finetune --distill`` can train it towards its own outputs.
    losses: tuple[str, ...]
    lora: bool
    distillable: bool

    def check_training(self, task: Any) -> None:
        """Raise ``UserError`` if the task's ``train.loss`` does not fit its labels."""
        ...

    def training_model(
        self, source: str, task: Any, overrides: Mapping[str, Any] | None = None
    ) -> TrainingModel:
        """The model with the head the loss trains (a fresh head where the checkpoint has none).

        ``overrides``: model config settings to load it with (an attention dropout).
        """
        ...

    def check_rows(self, rows: Sequence[dict[str, Any]], task: Any, where: Locator) -> None:
        """Refuse, before any training, a row the loss cannot take, naming where it is."""
        ...

    def training_features(self, rows: Sequence[dict[str, Any]], task: Any, trained: TrainingModel) -> Any:
        """The features the Trainer trains on (a list of dicts, or a dataset), at ``trained.max_length``."""
        ...

    def trainer(self, trained: TrainingModel, features: Any, setup: dict[str, Any]) -> Any:
        """The ``transformers.Trainer`` (or a subclass) over ``features``.

        ``setup``: ``arguments`` (the ``TrainingArguments``' values), ``callbacks``, and for distillation
        ``trainer_class`` with its own keyword arguments.
        """
        ...

    def save(self, model: Any, tokenizer: Any, output: Path) -> None:
        """Save the trained model (and its tokenizer) where ``evaluate`` loads it from."""
        ...


class HeadTraining:
    """The training members that kinds training a transformers head (classes, spans) share."""

    lora = True
    distillable = True

    def trainer(self, trained: TrainingModel, features: Any, setup: dict[str, Any]) -> Any:
        """``transformers.Trainer`` (``setup["trainer_class"]``: a subclass) with the kind's collator."""
        import transformers

        extra = dict(setup)
        trainer_class = extra.pop("trainer_class", transformers.Trainer)
        return trainer_class(
            model=trained.model,
            args=transformers.TrainingArguments(**extra.pop("arguments")),
            train_dataset=features,
            data_collator=self.collator(trained),
            callbacks=extra.pop("callbacks"),
            **extra,
        )

    def collator(self, trained: TrainingModel) -> Any:
        """Dynamic padding of each batch to its longest member."""
        import transformers

        return transformers.DataCollatorWithPadding(trained.tokenizer)

    def save(self, model: Any, tokenizer: Any, output: Path) -> None:
        """``save_pretrained`` of the model and its tokenizer."""
        model.save_pretrained(output)
        tokenizer.save_pretrained(output)


def check_text(value: Any, field: str) -> None:
    """Refuse a training text no tokenizer takes (missing, not a string, a lone surrogate)."""
    if value is None:
        raise UserError(f"no {field} (missing or null): every row needs its text")
    if not isinstance(value, str):
        raise UserError(f"{field} is a {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate (a JSON escape): no tokenizer takes it
        raise UserError(
            f"{field} is not valid Unicode: a lone surrogate U+{ord(value[error.start]):04X} at character "
            f"{error.start + 1}, which no tokenizer takes"
        ) from None


def check_each_row(
    rows: Sequence[dict[str, Any]], where: Locator, check: Callable[[dict[str, Any]], None]
) -> None:
    """``check`` every row; its ``UserError`` names the row's file and line (``where``)."""
    for index, row in enumerate(rows):
        try:
            check(row)
        except UserError as error:
            raise UserError(f"{where(index, row)}: {error}") from None


KINDS: dict[str, TaskKind] = {}


def register_kind(kind: TaskKind) -> TaskKind:
    """Add a kind under ``kind.name`` (idempotent for the same object)."""
    KINDS[kind.name] = kind
    return kind


def get_kind(task: Any) -> TaskKind:
    """The kind of ``task``, checked against the task (fields, options, metric names).

    Raises:
        UserError: no kind of that name, or the task does not suit it.
    """
    kind = KINDS.get(task.kind)
    if kind is None:
        raise UserError(
            f"task {task.name} has kind {task.kind!r}, which is not registered; known kinds: "
            f"{', '.join(sorted(KINDS))}"
        )
    check = getattr(kind, "check", None)
    if check is not None:
        check(task)
    return kind


def trainable(task: Any) -> TrainableKind:
    """The kind of ``task`` as a trainable one, its ``train:`` split checked against it.

    Raises:
        UserError: the task has no train split, its kind trains nothing, or not its loss.
    """
    kind = get_kind(task)
    if task.train is None:
        raise UserError(f"task {task.name} has no train split")
    losses = getattr(kind, "losses", ())
    if task.train.loss not in losses:
        raise UserError(f"task {task.name}: finetune does not train the loss {task.train.loss!r}")
    kind.check_training(task)  # type: ignore[attr-defined]
    return kind  # type: ignore[return-value]


def check_rows(rows: Sequence[dict[str, Any]], task: Any, where: Locator) -> None:
    """Refuse, before any training, a row whose texts or label the task's loss cannot take.

    Raises:
        UserError: naming the row's file and line (``where``), the field and what is allowed.
    """
    trainable(task).check_rows(rows, task, where)


def check_options(task: Any, allowed: Sequence[str]) -> None:
    """Refuse options the kind does not know (a typo would otherwise be ignored)."""
    unknown = sorted(set(task.options) - set(allowed))
    if unknown:
        raise UserError(
            f"task {task.name}: unknown option(s) {unknown} for kind {task.kind}; allowed: {sorted(allowed)}"
        )


def check_metrics(task: Any, allowed: Callable[[str], bool], described: str) -> None:
    """Refuse metric names the kind does not compute."""
    unknown = [name for name in task.metric_names if not allowed(name)]
    if unknown:
        raise UserError(
            f"task {task.name}: unknown metric(s) {unknown} for kind {task.kind}; allowed: {described}"
        )
    if not task.metric_names:
        raise UserError(f"task {task.name}: no metrics; allowed: {described}")


def positive_option(task: Any, key: str, value: Any, default: int | None = None) -> int | None:
    """``value`` as a positive int (``default`` when None); a UserError naming the task and key otherwise."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"task {task.name}: {key} must be a positive int, got {value!r}")
    return value


def first_n(items: list[Any], limit: int | None) -> list[Any]:
    """The first ``limit`` items (all without a limit)."""
    return items if limit is None else items[:limit]


# The built-in kinds register themselves on import.
from bert_cluster.tasks.kinds import (  # noqa: E402, F401
    classification,
    embedding,
    long_retrieval,
    masked_lm,
    squad,
)
