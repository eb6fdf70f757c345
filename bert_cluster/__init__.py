"""bert-cluster: improved clustered attention for pretrained BERT-family models.

Importing this package compiles nothing, imports neither transformers nor the kernels, touches no network
and leaves CUDA uninitialised. The attention name is registered with transformers when transformers'
modeling code loads (see ``bert_cluster._hook``), so a converted checkpoint reloads with its patch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bert_cluster import _hook
from bert_cluster._version import __version__
from bert_cluster.attention import clustered_attention
from bert_cluster.config import ClusteredAttentionConfig

_hook.install()

__all__ = [
    "ClusteredAttentionConfig",
    "__version__",
    "clustered_attention",
    "convert",
    "embed",
    "evaluate",
    "finetune",
    "info",
    "inspect_model",
    "revert",
]

if TYPE_CHECKING:
    from bert_cluster.embedding import embed
    from bert_cluster.evaluation import evaluate
    from bert_cluster.finetuning import finetune


def convert(model: Any, clusters: int | None = None, **settings: Any) -> Any:
    """Patch ``model`` in place with (improved) clustered attention; see ``bert_cluster.hf.convert``.

    ``clusters`` (also positional) and the other settings change ``convert``'s preset,
    ``ClusteredAttentionConfig.for_convert()`` (clusters=25 there); ``config=`` gives them all.
    """
    from bert_cluster.hf import convert as _convert

    if clusters is not None:
        settings["clusters"] = clusters
    return _convert(model, **settings)


def revert(model: Any) -> Any:
    """Restore the attention implementation ``model`` had before ``convert``."""
    from bert_cluster.hf import revert as _revert

    return _revert(model)


def inspect_model(model: Any, inputs: Any, tokenizer: Any = None, config: Any = None, **settings: Any) -> Any:
    """Per layer and head error of clustered against exact attention; see ``bert_cluster.inspection``."""
    from bert_cluster.inspection import inspect_model as _inspect_model

    return _inspect_model(model, inputs, tokenizer, config, **settings)


def info() -> dict[str, Any]:
    """Versions, kernel build status and each backend's availability (what ``bert-cluster env`` prints)."""
    from bert_cluster._build import build_info

    return build_info()


def __getattr__(name: str) -> Any:
    # The evaluation runner pulls in datasets, pandas and friends: load it only when asked for.
    # (Its package is `evaluation`, not `evaluate`: a subpackage of that name would shadow this function.)
    if name == "evaluate":
        from bert_cluster.evaluation import evaluate as _evaluate

        return _evaluate
    if name == "embed":  # a corpus into parquet embeddings (datasets, pyarrow, sentence-transformers)
        from bert_cluster.embedding import embed as _embed

        return _embed
    # HF Trainer, peft, datasets: only when asked for (its package is `finetuning`, for the same reason).
    if name == "finetune":
        from bert_cluster.finetuning import finetune as _finetune

        return _finetune
    raise AttributeError(f"module 'bert_cluster' has no attribute {name!r}")
