"""The settings of (improved) clustered attention, validated once and serialisable."""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

#: Bumped whenever the meaning of a field changes, so old results.json files stay interpretable.
#: 2: cluster_growth and topk_growth (version-1 dicts load with both 0, what they meant); min_length "auto".
CONFIG_VERSION = 2

MODES = ("i-clustered", "clustered", "i-clustered+")
BACKENDS = ("auto", "cpu", "cuda", "reference")
MAX_BITS = 63  # a hash must fit in one int64
#: Upper bound of clusters, topk and min_length: counts of tokens or clusters, which the kernels multiply
#: together (and by head dims) in int64; 2**31 - 1 is far above any sequence length and keeps those
#: products far from overflowing.
MAX_COUNT = 2**31 - 1
#: Upper bound of iterations: K-means stops at a fixed point long before (typically within 10 rounds).
MAX_ITERATIONS = 10_000
#: Rows with up to this many valid tokens (BERT's length) use ``clusters`` and ``topk`` as given.
GROWTH_START = 512
#: min_length="auto": rows too short for clustering to pay (measured per backend) use exact attention.
AUTO = "auto"

#: The two presets, as what each changes from the field defaults (``ClusteredAttentionConfig.for_convert``
#: and ``.for_evaluation``): ``convert`` keeps short rows exact where clustering would not pay on this
#: machine, so a converted model is never slower; the evaluator (evaluate, tune, inspect) approximates
#: every row longer than C, since its job is to measure the approximation.
CONVERT_SETTINGS: Mapping[str, Any] = types.MappingProxyType({"min_length": AUTO})
EVALUATION_SETTINGS: Mapping[str, Any] = types.MappingProxyType({"min_length": 0})


def check_setting_names(names: Iterable[str]) -> None:
    """Refuse names that are not settings (a misspelt keyword would otherwise be silently dropped).

    Raises:
        TypeError: naming the unknown ones and every allowed one.
    """
    allowed = [field.name for field in dataclasses.fields(ClusteredAttentionConfig)]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise TypeError(f"unknown clustered attention setting(s) {unknown}; allowed: {', '.join(allowed)}")


def check_int(name: str, value: Any, low: int, high: int, also: str = "") -> None:
    """Refuse ``value`` unless it is an int in ``low..high`` (the one message for every count setting)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{also}, got {type(value).__name__} {value!r}")
    if low <= value <= high:
        return
    if high <= MAX_BITS:  # a short range: name it whole
        raise ValueError(f"{name} must be in {low}..{high}{also}, got {value}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}{also}, got {value}")
    raise ValueError(f"{name} must be <= {high}{also}, got {value}")


def check_config(config: Any, function: str) -> ClusteredAttentionConfig:
    """``config`` as a function's settings argument: a ``ClusteredAttentionConfig``, or None (the defaults).

    Raises:
        TypeError: anything else, naming what was given and how to build a config from a mapping.
    """
    if config is None:
        return ClusteredAttentionConfig()
    if isinstance(config, ClusteredAttentionConfig):
        return config
    hint = ""
    if isinstance(config, Mapping):
        hint = ": build one with ClusteredAttentionConfig(**settings) or ClusteredAttentionConfig.from_dict()"
    raise TypeError(
        f"{function}: config must be a ClusteredAttentionConfig or None (the defaults), "
        f"got a {type(config).__name__}{hint}"
    )


class RowSettings(NamedTuple):
    """The cluster count C and top-k of a row of a given valid length (``config.row_settings``)."""

    clusters: int
    topk: int


@dataclasses.dataclass(frozen=True)
class ClusteredAttentionConfig:
    """How a model's self-attention is replaced.

    Attributes:
        clusters: C, the number of query clusters per head and row, for rows of up to 512 valid tokens.
        topk: k, keys per cluster recomputed exactly (i-clustered only), for rows of up to 512 valid
            tokens; capped at the valid keys of a row.
        bits: B, hash bits per query (1..63).
        iterations: L, Lloyd iterations of K-means in Hamming space (1..10,000; it stops at a fixed point).
        mode: "i-clustered+" (the default: i-clustered on a partition refined by Lloyd rounds on the
            query vectors, one at C >= 25 and up to three below (``attention.plus_lloyd_rounds``), each
            query with its own share of attention on the exact keys; README, "Fidelity"), "i-clustered"
            (the paper's improved clustered attention) or "clustered".
        min_length: rows with fewer valid tokens than this use exact attention (torch's SDPA over their
            valid keys; rows with at most C valid tokens always do: clustering saves nothing there).
            ``"auto"``: the length from which clustering is faster than SDPA on this machine, measured
            once and cached (``bert_cluster.crossover``); what ``convert`` uses by default
            (``for_convert``). 0 here and in the evaluator's preset (``for_evaluation``), so that every
            row longer than C is approximated (what evaluating the approximation needs).
        cluster_growth, topk_growth: how C and k grow with a row's valid length n above 512 tokens:
            ``C(n) = clusters * (n / 512) ** cluster_growth`` and ``k(n) = topk * (n / 512) **
            topk_growth``, rounded (``row_settings``); 0 keeps them fixed, 1 is linear. Nothing changes
            up to 512 tokens. The defaults, 0.5 and 0.5, give C=25, k=32 up to 512 tokens; C=35, k=45
            at 1,024; 50, 64 at 2,048; 100, 128 at 8,192; 141, 181 at 16,384. Chosen for i-clustered+ on
            the long-context proxy (README, "Cluster counts for long inputs"): a fixed C=25 loses accuracy
            as rows grow (document-embedding cosine to exact 0.970 at 8,192 tokens); these keep it above
            0.98 from 2k to 16k (0.989 at 8k and 16k) and the long-document recall@1 within 0.5 of exact
            at 8k, at the lowest cost measured that does both. The paper's mode needs more clusters for that
            (cluster_growth 0.75, topk_growth 0.5: C=200, k=128 at 8,192, cosine 0.981).
        seed: seeds the random hash planes; each layer draws its own stream from it.
        layers: indices of the attention layers to patch, or None for all of them.
        backend: "auto", "cpu", "cuda" or "reference" (see ``bert_cluster.info()``).
    """

    clusters: int = 25
    topk: int = 32
    bits: int = MAX_BITS
    iterations: int = 10
    mode: str = "i-clustered+"
    min_length: int | str = 0
    cluster_growth: float = 0.5
    topk_growth: float = 0.5
    seed: int = 0
    layers: tuple[int, ...] | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_int("clusters", self.clusters, 1, MAX_COUNT)
        check_int("topk", self.topk, 1, MAX_COUNT)
        check_int("bits", self.bits, 1, MAX_BITS)
        check_int("iterations", self.iterations, 1, MAX_ITERATIONS)
        if self.min_length != AUTO:
            if isinstance(self.min_length, str):
                raise ValueError(f"min_length must be an int or {AUTO!r}, got {self.min_length!r}")
            check_int("min_length", self.min_length, 0, MAX_COUNT, f" or {AUTO!r}")
        check_int("seed", self.seed, 0, 2**63 - 1)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("cluster_growth", "topk_growth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(
                    f"{name} must be a number in 0..1 (0: fixed, 1: linear in length), got {value!r}"
                )
            object.__setattr__(self, name, float(value))
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
        self._intern()

    def __hash__(self) -> int:
        """The fields' hash, computed once: attention's plan cache looks the config up on every call."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, field.name) for field in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """The fields without the cached hash and number (both differ between processes)."""
        return {name: value for name, value in self.__dict__.items() if name not in ("_hash", "_number")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._intern()

    def _intern(self) -> None:
        settings = tuple(getattr(self, field.name) for field in dataclasses.fields(self))
        with _NUMBERS_LOCK:
            number = _NUMBERS.setdefault(settings, len(_NUMBERS))
            if number == len(_BY_NUMBER):
                _BY_NUMBER.append(self)
        object.__setattr__(self, "_number", number)

    @classmethod
    def for_convert(cls, **changes: Any) -> ClusteredAttentionConfig:
        """``convert``'s defaults (``min_length="auto"``, see ``CONVERT_SETTINGS``) with ``changes``.

        Raises:
            TypeError: a name that is not a setting (or a value of the wrong type).
            ValueError: a value out of range.
        """
        check_setting_names(changes)
        return cls(**{**CONVERT_SETTINGS, **changes})

    @classmethod
    def for_evaluation(cls, **changes: Any) -> ClusteredAttentionConfig:
        """The evaluator's defaults (``min_length=0``, see ``EVALUATION_SETTINGS``) with ``changes``.

        Raises:
            TypeError: a name that is not a setting (or a value of the wrong type).
            ValueError: a value out of range.
        """
        check_setting_names(changes)
        return cls(**{**EVALUATION_SETTINGS, **changes})

    def row_settings(self, length: int) -> RowSettings:
        """``(clusters, topk)`` for a row of ``length`` valid tokens (see ``cluster_growth``)."""
        if length <= GROWTH_START:
            return RowSettings(self.clusters, self.topk)
        ratio = length / GROWTH_START
        clusters = round(self.clusters * ratio**self.cluster_growth)
        topk = round(self.topk * ratio**self.topk_growth)
        return RowSettings(min(MAX_COUNT, clusters), min(MAX_COUNT, topk))

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
        if version < 2:
            # version 1 had one cluster count and top-k at every length
            data.setdefault("cluster_growth", 0.0)
            data.setdefault("topk_growth", 0.0)
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


def number_of(config: ClusteredAttentionConfig) -> int:
    """``config``'s number in this process, the same for equal settings (``config_of`` gives it back).

    A custom op takes numbers, not objects: torch.compile's op of a whole attention call
    (``attention.clustered_attention``) takes the config as its number, so that the op's body gets a config
    object as it is (the first of its settings), neither a dict nor one built anew from fields.
    """
    return config.__dict__["_number"]


def config_of(number: int) -> ClusteredAttentionConfig:
    """The config whose number is ``number`` (``number_of``; the first of equal ones)."""
    return _BY_NUMBER[number]


#: The settings of every distinct config of this process and its number (``number_of``): a handful in a
#: run (the tuner's grid at most tens).
_NUMBERS: dict[tuple, int] = {}
_BY_NUMBER: list[ClusteredAttentionConfig] = []
_NUMBERS_LOCK = threading.Lock()
