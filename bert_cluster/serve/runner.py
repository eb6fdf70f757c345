"""The model behind the server, on the offline path: ``embed``'s loading and its ``encode`` call.

``open_sentence_encoder`` loads, truncates and converts the model exactly as ``bert_cluster.embed`` does,
and every batch goes through ``encode_batch`` (one ``SentenceTransformer.encode`` pass), so a served
embedding is the offline one. Each thread that counts tokens does so with its own copy of the tokenizer
(the event loop for short requests, a counting thread for long ones, the model's thread in the warm-up):
a fast tokenizer changes its truncation settings on a call, which two threads must not do to one
instance at once (the model's own tokenizer is ``encode``'s).
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from bert_cluster import crossover
from bert_cluster.checkpoints import SentenceEncoder, count_tokens, encode_batch, open_sentence_encoder
from bert_cluster.serve.settings import ServeSettings

#: Tokens of the warm-up's long input (or the longest input allowed, if fewer): longer than any C, so
#: that a clustered model measures ``min_length="auto"`` then, not on a user's first long request.
WARMUP_TOKENS = 512


class ModelRunner:
    """Loads the model of resolved ``settings`` (``ServeSettings.resolve``) and embeds batches of texts."""

    def __init__(self, settings: ServeSettings) -> None:
        import torch

        if settings.max_input_tokens is None:
            raise ValueError("ModelRunner takes resolved settings (ServeSettings.resolve)")
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.settings = settings
        self.encoder: SentenceEncoder = open_sentence_encoder(
            settings.model, settings.device, settings.dtype, settings.max_input_tokens, settings.config
        )
        model = self.encoder.model
        self.dimension: int = model.get_embedding_dimension()
        self.lowercase = bool(getattr(model[0], "do_lower_case", False))
        self._tokenizer = copy.deepcopy(model.tokenizer)  # only ever copied: one per counting thread
        self._local = threading.local()
        self._counting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bert-cluster-tokens")
        self.warmup: dict[str, Any] | None = None

    @property
    def normalizes(self) -> bool:
        """Whether the model's own modules end in Normalize (its embeddings have unit length)."""
        return bool(self.encoder.modules["normalize"])

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's tokens with the special ones, before truncation (with this thread's tokenizer)."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return count_tokens(tokenizer, texts, self.lowercase)

    @property
    def counting(self) -> concurrent.futures.Executor:
        """The thread token counts run on (one, with its own tokenizer)."""
        return self._counting

    def call_between_layers(self, callback: Callable[[], None]) -> int:
        """Have every pass call ``callback()`` as each layer's attention begins; the layers hooked.

        The batcher's ``between_layers`` goes here. 0 hooked: the model's attention modules are not found
        (the server then runs every batch whole).
        """
        from bert_cluster.hf import attention_modules

        modules = attention_modules(self.encoder.model)
        for module in modules:
            module.register_forward_pre_hook(lambda _module, _args: callback())
        return len(modules)

    def embed(self, texts: list[str]) -> Any:
        """One batch of texts: a float32 numpy matrix, one row per text, in order."""
        return encode_batch(self.encoder.model, texts)

    def warm_up(self) -> dict[str, Any]:
        """Run a batch of short inputs and one long one; what it took and measured (``/info`` shows it)."""
        longest = min(WARMUP_TOKENS, self.settings.max_input_tokens or WARMUP_TOKENS)
        long_text = self.text_of(longest)
        began = time.perf_counter()
        self.embed(["warm-up", "a warm-up query of a few more words"])
        self.embed([long_text])
        self.warmup = {
            "seconds": round(time.perf_counter() - began, 3),
            "long_input_tokens": self.count_tokens([long_text])[0],
            "min_length": crossover.measured(),
        }
        return self.warmup

    def text_of(self, tokens: int) -> str:
        """A text of about ``tokens`` tokens with the special ones (never more)."""
        words = max(1, tokens - 2)
        while words > 1 and self.count_tokens(["a " * words])[0] > tokens:
            words -= 1
        return "a " * words
