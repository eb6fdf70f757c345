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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
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
from bert_cluster.tasks.kinds import classification, embedding, long_retrieval, squad  # noqa: E402, F401
