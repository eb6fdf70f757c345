"""Task kinds: how a family of tasks loads its model and data and scores one configuration.

The runner (``bert_cluster.evaluation.runner``) knows nothing about classification, SQuAD or sentence
embeddings: it looks up ``task.kind`` here, loads the model and the examples once, then scores the
unmodified model and every patched configuration through the same ``score`` function, calling
``bert_cluster.convert`` / ``revert`` on ``LoadedModel.model`` in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

#: Called by a kind as it works through batches: ``advance(done, total)``.
Progress = Callable[[int, int], None]


@dataclasses.dataclass
class LoadedModel:
    """A model ready to score; ``model`` is the transformers model that ``convert`` patches."""

    model: torch.nn.Module
    tokenizer: Any
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. pooling mode, label map


@dataclasses.dataclass
class Examples:
    """A task's evaluation examples and the file they were read from (named in the report)."""

    items: Any
    source: str
    count: int


@dataclasses.dataclass(frozen=True)
class ScoreSettings:
    """Per-run settings every kind honours."""

    batch_size: int = 32
    max_length: int | None = None  # None: the task's default
    device: str = "cpu"


class TaskKind(Protocol):
    """What a kind provides. ``task`` is a ``bert_cluster.evaluation.tasks.TaskConfig``."""

    name: str

    def load_model(self, model: str | Path, task: Any, device: str) -> LoadedModel:
        """Load ``model`` (hub id or folder) with the head the task needs; check the head fits."""
        ...

    def load_examples(self, task: Any, data_dir: Path | None, limit: int | None) -> Examples:
        """Read the task's dev examples (local files first, the hub when reachable)."""
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
