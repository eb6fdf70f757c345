"""What a server runs and the limits it keeps: ``ServeSettings``, validated once, before anything loads.

The CLI builds one from its options, ``create_app`` takes one, and ``--workers N`` hands it to each worker
process as JSON (``to_dict`` / ``from_dict``). ``resolve`` fills in what depends on the model (its
positions) and refuses settings that contradict each other, at start rather than at the first request:
a token budget below the longest input allowed would leave that input queued for ever (TEI issue 723).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bert_cluster.checkpoints import ENCODER_DTYPES
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError, positive_int

#: Padded tokens (inputs x longest input) per model pass when the model's positions are fewer.
DEFAULT_MAX_BATCH_TOKENS = 16384
#: The limits that are counts, each at least 1.
COUNTS = ("max_batch_requests", "max_client_batch_size", "max_concurrent_requests", "payload_limit")


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """A server's model, attention and limits (``bert-cluster serve --help`` describes each option).

    Attributes:
        model: a SentenceTransformer or transformers folder, ``package:NAME`` or a hub id.
        exact: keep the model's own attention (no ``convert``).
        attention: the clustered-attention config (None: ``convert``'s preset); refused with ``exact``.
        device: cpu, cuda or cuda:N.
        dtype: float32 or bfloat16 (embeddings are float32 either way).
        threads: torch's intra-op threads (None: torch's default); ``--workers`` splits them.
        model_name: the name answers carry in ``model`` (default: the model folder's name).
        max_input_tokens: the longest input, in tokens with the special ones (default: the model's
            positions); a longer one is refused, or cut there when the request asks to truncate.
        max_batch_tokens: padded tokens (inputs x longest input) per model pass (default: the larger of
            16,384 and ``max_input_tokens``); never below ``max_input_tokens``.
        max_batch_requests: inputs per model pass.
        max_wait_ms: how long the batcher waits for more inputs to fill a batch.
        max_client_batch_size: inputs one request may send.
        max_concurrent_requests: requests in flight (queued or running); more are answered 429.
        payload_limit: request bodies past this many bytes are answered 413.
        api_key: when set, every route but /health and /ready needs ``Authorization: Bearer KEY``.
        cors_origins: origins allowed cross-origin requests (none: CORS off).
        warmup: run the model once before /ready says ready (it also measures ``min_length="auto"``).
        interleave: run batches of short inputs between the layers of a long batch, so that a query
            behind a long document waits for one of its layers, not the whole pass (``serve.batcher``).
    """

    model: str
    exact: bool = False
    attention: ClusteredAttentionConfig | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    model_name: str | None = None
    max_input_tokens: int | None = None
    max_batch_tokens: int | None = None
    max_batch_requests: int = 128
    max_wait_ms: float = 5.0
    max_client_batch_size: int = 64
    max_concurrent_requests: int = 512
    payload_limit: int = 2_000_000
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    warmup: bool = True
    interleave: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise UserError(f"model must be a non-empty string, got {self.model!r}")
        if self.attention is not None and not isinstance(self.attention, ClusteredAttentionConfig):
            raise UserError(
                f"attention must be a ClusteredAttentionConfig, got {type(self.attention).__name__}"
            )
        if self.exact and self.attention is not None:
            raise UserError("exact serves the unmodified model: give no attention settings with it")
        if self.dtype not in ENCODER_DTYPES:
            raise UserError(f"dtype must be one of {', '.join(ENCODER_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UserError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("threads", "max_input_tokens", "max_batch_tokens"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        for name in COUNTS:
            positive_int(name, getattr(self, name))
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (0 <= wait < math.inf):
            raise UserError(f"max_wait_ms must be a number of milliseconds >= 0, got {wait!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise UserError("api_key must be a non-empty string (or None: no key)")
        if isinstance(self.cors_origins, str) or not all(isinstance(o, str) for o in self.cors_origins):
            raise UserError(f"cors_origins must be a list of origins, got {self.cors_origins!r}")
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))

    @property
    def config(self) -> ClusteredAttentionConfig | None:
        """The config the model is converted with (None when exact)."""
        if self.exact:
            return None
        return self.attention or ClusteredAttentionConfig.for_convert()

    @property
    def served_name(self) -> str:
        """The name answers carry: ``model_name``, else the model folder's (or hub id's) last part."""
        if self.model_name:
            return self.model_name
        return Path(self.model.removeprefix("package:").rstrip("/")).name or self.model

    def resolve(self, positions: int | None) -> ServeSettings:
        """These settings with the limits that depend on the model filled in, and checked together.

        ``positions``: the longest input the model takes (None when its config does not say).

        Raises:
            UserError: ``max_input_tokens`` past the model's positions, or ``max_batch_tokens`` below
                ``max_input_tokens`` (such an input could never be batched), or no limit to go by.
        """
        longest = self.max_input_tokens
        if longest is None:
            if positions is None:
                raise UserError("the model's config gives no position count: set max_input_tokens")
            longest = positions
        elif positions is not None and longest > positions:
            raise UserError(f"max_input_tokens {longest} is more than the model's {positions} positions")
        budget = self.max_batch_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_BATCH_TOKENS, longest)
        elif budget < longest:
            raise UserError(
                f"max_batch_tokens {budget} is below max_input_tokens {longest}: an input of {longest} "
                f"tokens could never be batched; raise max_batch_tokens to at least {longest} or lower "
                "max_input_tokens"
            )
        return dataclasses.replace(self, max_input_tokens=longest, max_batch_tokens=budget)

    def to_dict(self, secrets: bool = False) -> dict[str, Any]:
        """JSON-ready settings; the API key only with ``secrets`` (``/info`` says whether one is set)."""
        data = dataclasses.asdict(self)
        data["attention"] = None if self.attention is None else self.attention.to_dict()
        data["cors_origins"] = list(self.cors_origins)
        if not secrets:
            data["api_key"] = self.api_key is not None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServeSettings:
        """The settings ``to_dict(secrets=True)`` wrote."""
        values = dict(data)
        if values.get("attention") is not None:
            values["attention"] = ClusteredAttentionConfig.from_dict(values["attention"])
        values["cors_origins"] = tuple(values.get("cors_origins") or ())
        return cls(**values)
