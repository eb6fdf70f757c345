"""The transformers glue: one attention function, one mask function, ``convert`` and ``revert``.

transformers 5.x looks attention up by name (``AttentionInterface``) and builds the mask with the
function registered under the same name (``AttentionMaskInterface``); without a mask function a new
attention receives ``attention_mask=None`` and padding is silently ignored. We register both under
``ATTENTION_NAME``. The settings live in ``model.config.clustered_attention`` (a plain dict, saved by
``save_pretrained``), and ``model.config.attn_implementation`` makes ``from_pretrained`` select this
implementation again; see ``install_registration_hook`` for how that works without registering at import.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from bert_cluster.attention import clustered_attention
from bert_cluster.config import ClusteredAttentionConfig

ATTENTION_NAME = "bert_cluster"  # no "flash" (would import FlashAttention), no "/" (would mean a Hub kernel)
SETTINGS_KEY = "clustered_attention"

#: model_type values whose attention goes through transformers' AttentionInterface (checked on 5.24).
SUPPORTED_FAMILIES = ("bert", "roberta", "distilbert", "electra", "albert", "xlm-roberta", "camembert")
#: Families that share one attention module across layers: ``layers`` cannot select among them.
SHARED_LAYER_FAMILIES = ("albert",)

logger = logging.getLogger(__name__)
_registered = False
_warned_dropout = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, key_padding_mask)
    _registered = True


def key_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers hands to ``attention_forward``: bool ``(batch, kv_length)``, True on real tokens.

    Clustered attention needs per-row valid keys, not a 4-D bias. The mask is passed on even when
    nothing is padded: testing that would be a host sync and a torch.compile graph break.
    """
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:].to(torch.bool)


def _settings_of(config: Any) -> tuple[ClusteredAttentionConfig, str]:
    """The patch settings stored on a model config, parsed once and cached on the dict's identity."""
    stored = getattr(config, SETTINGS_KEY, None)
    if not isinstance(stored, dict):
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} needs config.{SETTINGS_KEY}; "
            "use bert_cluster.convert(model)"
        )
    cached = _PARSED.get(id(stored))
    if cached is not None and cached[0] is stored:
        return cached[1], cached[2]
    settings = dict(stored)
    original = settings.pop("original_attn_implementation", "sdpa")
    parsed = ClusteredAttentionConfig.from_dict(settings)
    _PARSED[id(stored)] = (stored, parsed, original)
    return parsed, original


_PARSED: dict[int, tuple[dict, ClusteredAttentionConfig, str]] = {}
_FIRST_SEEN: dict[int, int] = {}  # id(config) -> attention modules seen so far (for modules without an index)


def _layer_index(module: torch.nn.Module) -> int:
    """The layer a module computes: set by ``convert``, else ``layer_idx``, else order of first call."""
    index = getattr(module, "_bert_cluster_layer", None)
    if index is None:
        index = getattr(module, "layer_idx", None)
    if index is None:
        # DistilBERT has no layer_idx; a reloaded model calls its layers in order, so first-seen order is it.
        key = id(module.config)
        index = _FIRST_SEEN.get(key, 0)
        _FIRST_SEEN[key] = index + 1
        module._bert_cluster_layer = index
    return int(index)


def _valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Per-row valid keys from whatever mask arrived (ours is 2-D; a user's 4-D padding mask is accepted)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask.to(torch.bool)
    if attention_mask.dim() == 4:
        valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        if valid.shape[-2] == 1 or bool((valid == valid[:, :, :1, :]).all()):
            return valid[:, 0, 0, :].expand(batch, length)
    raise ValueError(
        "clustered attention supports key-padding masks only (2-D, or 4-D constant over queries); "
        f"got a mask of shape {tuple(attention_mask.shape)}"
    )


def _original_forward(module: torch.nn.Module, name: str):
    """The attention function a layer that is not patched keeps using, and the mask it expects."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        import sys

        return sys.modules[type(module).__module__].eager_attention_forward, "additive"
    return ALL_ATTENTION_FUNCTIONS["sdpa" if name not in ALL_ATTENTION_FUNCTIONS else name], "bool"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: q, k, v ``(B, H, L, D)`` -> output ``(B, L, H, D)`` and no weights."""
    global _warned_dropout
    config, original = _settings_of(module.config)
    layer = _layer_index(module)
    if kwargs.get("output_attentions"):
        raise ValueError(
            "clustered attention computes no attention matrix: output_attentions is not supported"
        )
    batch, _, length, _ = query.shape
    valid = _valid_from_mask(attention_mask, batch, key.shape[-2])
    selected = config.layers is None or layer in config.layers
    if not selected or key.shape[-2] != length:
        fn, mask_kind = _original_forward(module, original)
        mask = None
        if valid is not None:
            mask = valid[:, None, None, :]
            if mask_kind == "additive":
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~mask, torch.finfo(query.dtype).min
                )
        return fn(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout > 0 and not _warned_dropout:
        logger.warning("clustered attention applies no attention dropout (it is meant for inference)")
        _warned_dropout = True
    out = clustered_attention(query, key, value, valid, config, scaling=scaling, layer=layer)
    return out.transpose(1, 2).contiguous(), None


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules in layer order (a shared module appears once)."""
    found, seen = [], set()
    for module in model.modules():
        if id(module) in seen or not hasattr(module, "config"):
            continue
        name = type(module).__name__
        if name.endswith(("SelfAttention", "Attention")) and hasattr(module, "forward"):
            has_projection = any(hasattr(module, attr) for attr in ("query", "q_lin", "q_proj", "Wqkv"))
            if has_projection:
                found.append(module)
                seen.add(id(module))
    return found


def _check_model(model: Any) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError as error:  # pragma: no cover - transformers is a dependency
        raise TypeError("bert_cluster.convert needs transformers installed") from error
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"convert expects a transformers PreTrainedModel (e.g. from AutoModel.from_pretrained), "
            f"got {type(model).__name__}"
        )
    family = getattr(model.config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model family {family!r} does not route attention through transformers' AttentionInterface, so "
            f"clustered attention cannot be plugged in; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if getattr(model.config, "is_decoder", False) or getattr(model.config, "add_cross_attention", False):
        raise ValueError(
            "clustered attention replaces bidirectional self-attention; this model is configured as a "
            "decoder (is_decoder / add_cross_attention), which it does not support"
        )


def convert(
    model: Any,
    clusters: int = 25,
    *,
    topk: int = 32,
    bits: int = 63,
    iterations: int = 10,
    mode: str = "i-clustered",
    layers: list[int] | tuple[int, ...] | None = None,
    seed: int = 0,
    min_length: int | str = "auto",
    cluster_growth: float = ClusteredAttentionConfig.cluster_growth,
    topk_growth: float = ClusteredAttentionConfig.topk_growth,
    backend: str = "auto",
    config: ClusteredAttentionConfig | None = None,
) -> Any:
    """Patch a BERT-family model in place with (improved) clustered attention and return it.

    Args:
        model: a transformers ``PreTrainedModel`` of a supported family (BERT, RoBERTa, DistilBERT,
            ELECTRA, ALBERT, XLM-R, CamemBERT).
        clusters, topk, bits, iterations, mode, layers, seed, min_length, cluster_growth, topk_growth,
            backend: see ``ClusteredAttentionConfig``; ``layers`` indexes the model's attention layers.
        config: a ready ``ClusteredAttentionConfig``; when given, the keyword settings are ignored.

    ``min_length`` defaults to ``"auto"`` here (``ClusteredAttentionConfig`` defaults to 0): rows too short
    for clustering to pay on this machine run torch's SDPA, so a converted model is never slower than
    the unmodified one; pass ``min_length=0`` to approximate every row longer than C (as the evaluator
    does, to measure the approximation).

    Converting an already converted model replaces its settings; ``revert`` restores the
    implementation the model had before the first ``convert``.
    """
    if config is None:
        config = ClusteredAttentionConfig(
            clusters=clusters,
            topk=topk,
            bits=bits,
            iterations=iterations,
            mode=mode,
            layers=tuple(layers) if isinstance(layers, list) else layers,
            seed=seed,
            min_length=min_length,
            cluster_growth=cluster_growth,
            topk_growth=topk_growth,
            backend=backend,
        )
    elif not isinstance(config, ClusteredAttentionConfig):
        raise TypeError(f"config must be a ClusteredAttentionConfig, got {type(config).__name__}")
    _check_model(model)
    modules = _attention_modules(model)
    layer_count = getattr(model.config, "num_hidden_layers", None) or getattr(
        model.config, "n_layers", len(modules)
    )
    if config.layers is not None:
        if model.config.model_type in SHARED_LAYER_FAMILIES:
            raise ValueError(
                f"{model.config.model_type} shares one attention module across its layers, "
                "so layers must be None"
            )
        bad = [i for i in config.layers if not 0 <= i < layer_count]
        if bad:
            raise ValueError(
                f"layer index(es) {bad} out of range: this model has layers 0..{layer_count - 1}"
            )

    register()
    previous = getattr(model.config, SETTINGS_KEY, None)
    current = model.config._attn_implementation
    original = previous.get("original_attn_implementation", "sdpa") if isinstance(previous, dict) else current
    for index, module in enumerate(modules):
        module._bert_cluster_layer = index
    setattr(
        model.config, SETTINGS_KEY, {**config.to_dict(), "original_attn_implementation": original or "sdpa"}
    )
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        delattr(model.config, SETTINGS_KEY)
        raise ValueError(
            f"transformers did not switch {type(model).__name__} to {ATTENTION_NAME!r}; "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    model.config.attn_implementation = ATTENTION_NAME  # public: saved in config.json, read by from_pretrained
    return model


def revert(model: Any) -> Any:
    """Switch a converted model back to the attention implementation it had before ``convert``."""
    settings = getattr(getattr(model, "config", None), SETTINGS_KEY, None)
    if not isinstance(settings, dict):
        raise ValueError("this model was not converted by bert_cluster (no config.clustered_attention)")
    original = settings.get("original_attn_implementation", "sdpa")
    model.set_attn_implementation(original)
    delattr(model.config, SETTINGS_KEY)
    if hasattr(model.config, "attn_implementation"):
        delattr(model.config, "attn_implementation")
    for module in _attention_modules(model):
        if hasattr(module, "_bert_cluster_layer"):
            del module._bert_cluster_layer
    return model
