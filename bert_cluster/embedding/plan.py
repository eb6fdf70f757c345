"""The work of an embed run: shards, token counts and batches.

Shards are runs of consecutive documents (``shard_size`` each, the last one shorter), so the output is in
input order, and their names follow from the number of documents alone. Inside a shard the documents are
sorted by length (longest first, ties by position) and cut into batches whose padded size, rows x
longest row, stays within the token budget: a shard's batches depend on its own documents only, so they
are planned when the shard is read (``make_plan`` plans a whole corpus at once, the same batches). The
plan depends on the documents and the settings only, never on the number of processes: a process runs
whole shards, and every shard is embedded in the same batches whoever runs it, which is what makes a
resumed or a multi-process output equal a one-process run's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

from bert_cluster.checkpoints import count_tokens

__all__ = ["Shard", "batches_within", "count_tokens", "ids_sha256", "make_plan", "shard_name", "shard_names"]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One output file's documents (positions in the corpus) and their batches (positions too)."""

    index: int
    documents: range
    batches: tuple[tuple[int, ...], ...]

    @property
    def name(self) -> str:
        """The shard's file name in the output folder."""
        return shard_name(self.index)


def shard_name(index: int) -> str:
    """The file name of shard ``index`` in the output folder."""
    return f"shard-{index:05d}.parquet"


def ids_sha256(ids: Iterable[str]) -> str:
    """sha256 of a shard's ids in order (each length-prefixed): which documents the shard holds."""
    digest = hashlib.sha256()
    for identifier in ids:
        encoded = identifier.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def shard_names(documents: int, shard_size: int) -> list[str]:
    """The file names of the shards of ``documents`` documents, in order."""
    return [shard_name(index) for index in range(-(-documents // shard_size))]


def batches_within(lengths: Sequence[int], positions: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    """``positions`` sorted longest first and cut so that rows x longest row <= ``budget``.

    A document longer than the budget runs alone. ``lengths`` are the lengths the model sees (truncated).
    """
    order = sorted(positions, key=lambda position: (-lengths[position], position))
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    for position in order:
        # Longest first: the batch's first row sets its padded length.
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(tuple(current))
            current = []
        current.append(position)
    if current:
        batches.append(tuple(current))
    return batches


def make_plan(lengths: Sequence[int], shard_size: int, budget: int) -> list[Shard]:
    """The shards of ``len(lengths)`` documents and their batches (see the module docstring)."""
    shards = []
    for index, start in enumerate(range(0, len(lengths), shard_size)):
        documents = range(start, min(start + shard_size, len(lengths)))
        shards.append(Shard(index, documents, tuple(batches_within(lengths, documents, budget))))
    return shards
