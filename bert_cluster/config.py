"""The settings of (improved) clustered attention, validated once and serialisable."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

#: Bumped whenever the meaning of a field changes, so old results.json files stay interpretable.
CONFIG_VERSION = 1

MODES = ("i-clustered", "clustered", "i-clustered+")
BACKENDS = ("auto", "cpu", "cuda", "reference")
MAX_BITS = 63  # a hash must fit in one int64


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be {allowed}, got {value}")


@dataclasses.dataclass(frozen=True)
class ClusteredAttentionConfig:
    """How a model's self-attention is replaced.

    Attributes:
        clusters: C, the number of query clusters per head and sequence.
        topk: k, keys per cluster recomputed exactly (i-clustered only); capped at the valid keys of a row.
        bits: B, hash bits per query (1..63).
        iterations: L, Lloyd iterations of K-means in Hamming space.
        mode: "i-clustered" (improved clustered attention) or "clustered".
        min_length: rows with fewer valid tokens than this use exact attention (rows with at most
            C valid tokens always do: clustering cannot save anything there).
        seed: seeds the random hash planes; each layer draws its own stream from it.
        layers: indices of the attention layers to patch, or None for all of them.
        backend: "auto", "cpu", "cuda" or "reference" (see ``bert_cluster.info()``).
    """

    clusters: int = 25
    topk: int = 32
    bits: int = MAX_BITS
    iterations: int = 10
    mode: str = "i-clustered"
    min_length: int = 0
    seed: int = 0
    layers: tuple[int, ...] | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        _check_int("clusters", self.clusters, 1)
        _check_int("topk", self.topk, 1)
        _check_int("bits", self.bits, 1, MAX_BITS)
        _check_int("iterations", self.iterations, 1)
        _check_int("min_length", self.min_length, 0)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
                raise TypeError(f"layers must be None or a sequence of ints, got {self.layers!r}")
            for index in self.layers:
                if isinstance(index, bool) or not isinstance(index, int):
                    raise TypeError(f"layers must hold ints, got {index!r}")
            # Frozen: normalise lists to a sorted tuple without duplicates.
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a ``version`` key, as stored in ``model.config`` and results.json."""
        data = dataclasses.asdict(self)
        data["layers"] = list(self.layers) if self.layers is not None else None
        data["version"] = CONFIG_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusteredAttentionConfig:
        """Inverse of :meth:`to_dict`; rejects unknown keys and newer versions."""
        data = dict(data)
        version = data.pop("version", CONFIG_VERSION)
        if not isinstance(version, int) or version > CONFIG_VERSION:
            raise ValueError(
                f"clustered attention config version {version!r} is newer than this bert-cluster "
                f"understands (<= {CONFIG_VERSION}); upgrade bert-cluster"
            )
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown clustered attention setting(s) {unknown}; allowed: {sorted(known)}")
        if data.get("layers") is not None:
            data["layers"] = tuple(data["layers"])
        return cls(**data)

    def replace(self, **changes: Any) -> ClusteredAttentionConfig:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)
