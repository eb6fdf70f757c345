"""The transformers glue: one attention function, one mask function, ``convert`` and ``revert``.

transformers 5.x looks attention up by name (``AttentionInterface``) and builds the mask with the
function registered under the same name (``AttentionMaskInterface``); without a mask function a new
attention receives ``attention_mask=None`` and padding is silently ignored. We register both under
``ATTENTION_NAME``. The settings live in ``model.config.clustered_attention`` (a dict that
``save_pretrained`` saves, holding the config object the attention function reads: ``StoredSettings``),
and ``model.config.attn_implementation`` makes ``from_pretrained`` select this implementation again; see
``bert_cluster._hook`` for how that works without registering at import.

Which models qualify is read from the model itself: a text encoder (fed ``input_ids``) whose attention
modules look their implementation up in ``ALL_ATTENTION_FUNCTIONS`` and are not causal. Global layers run
(improved) clustered attention on the queries and keys the interface receives (after any rotary
embedding); sliding-window layers (the keyword ``sliding_window``) run the exact band.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys
import threading
from collections.abc import Sized
from typing import Any

import torch

from bert_cluster.attention import clustered_attention, windowed_attention
from bert_cluster.config import ClusteredAttentionConfig, check_setting_names

#: The implementation's name, which a converted checkpoint's config.json saves: transformers refuses it
#: when bert_cluster was not imported, and its error quotes the name alone, so the name says what to do.
#: No "flash" (would import FlashAttention), no "/" (would mean a Hub kernel).
ATTENTION_NAME = "bert_cluster (import bert_cluster before from_pretrained)"
#: The names earlier versions saved, registered too: their checkpoints load as before.
EARLIER_NAMES = ("bert_cluster",)
SETTINGS_KEY = "clustered_attention"

#: model_type values covered by the test suite (tests/families.py imports these lists); any other family
#: whose attention goes through the interface is converted too. Checked on transformers 5.24.
#: The families tested in full (the ones the README names).
SUPPORTED_FAMILIES = (
    "bert",
    "roberta",
    "distilbert",
    "electra",
    "albert",
    "xlm-roberta",
    "camembert",
    "modernbert",
    "nomic_bert",
    "gte",
    "jina_embeddings_v3",
    "eurobert",
    "ultrabert",
    "neomme",
)
#: Further native families whose attention goes through the interface, tested lighter.
ROUTED_FAMILIES = (
    "xlm-roberta-xl",
    "roberta-prelayernorm",
    "xmod",
    "roc_bert",
    "ernie",
    "esm",
    "mobilebert",
    "data2vec-text",
    "bert-generation",
)
TESTED_FAMILIES = SUPPORTED_FAMILIES + ROUTED_FAMILIES

logger = logging.getLogger(__name__)
_registered = False
_index_lock = threading.Lock()


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in (ATTENTION_NAME, *EARLIER_NAMES):
        AttentionInterface.register(name, attention_forward)
        AttentionMaskInterface.register(name, key_padding_mask)
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

    Clustered attention needs per-row valid keys, not a 4-D bias; a sliding window arrives separately as
    the ``sliding_window`` keyword. When nothing is padded the mask is None, as in transformers' own SDPA
    path, so that a forward pass holds no mask of its own: checked on the CPU only, where reading the mask
    costs nothing (on a GPU it would be a host sync, and under torch.compile a graph break).
    """
    if kwargs.get("use_vmap"):  # set by transformers only when a model adds its own or/and mask function
        raise ValueError(
            "this model combines its attention mask with a mask function of its own, which a key-padding "
            "mask cannot express; clustered attention does not support it"
        )
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.device.type == "cpu" and not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask.to(torch.bool)


# --- settings and layer indices ----------------------------------------------------------------------


class StoredSettings(dict):
    """``model.config.clustered_attention``: the settings as ``save_pretrained`` saves them, and their object.

    The dict is the config's ``to_dict()`` with ``original_attn_implementation`` (what ``revert`` restores);
    ``convert`` stores it holding the very ``ClusteredAttentionConfig`` it was given, and the attention
    function reads that object (``settings_of``): no parse and no dict on the forward. A checkpoint reloaded
    by ``from_pretrained`` holds a plain dict, parsed once on its first forward; a setting changed in place
    (``config.clustered_attention["clusters"] = 6``) is parsed on the next forward. A copy of it (deepcopy,
    pickle) is a plain dict, parsed again when it is used.
    """

    _parsed: tuple[ClusteredAttentionConfig, str] | None = None

    @classmethod
    def of(cls, config: ClusteredAttentionConfig, original: str) -> StoredSettings:
        """The settings of ``config`` on a model whose own attention implementation is ``original``."""
        stored = cls({**config.to_dict(), "original_attn_implementation": original})
        stored._parsed = (config, original)
        return stored

    def parsed(self) -> tuple[ClusteredAttentionConfig, str]:
        """The config object and the original implementation (parsed only after an edit)."""
        return self._parse() if self._parsed is None else self._parsed

    @torch.compiler.disable
    def _parse(self) -> tuple[ClusteredAttentionConfig, str]:
        settings = dict(self)
        original = settings.pop("original_attn_implementation", "sdpa")
        try:
            self._parsed = (ClusteredAttentionConfig.from_dict(settings), original)
        except (TypeError, ValueError) as error:
            raise type(error)(f"config.{SETTINGS_KEY} is invalid: {error}") from error
        return self._parsed

    def _edited(self) -> None:
        self._parsed = None

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._edited()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._edited()

    def __ior__(self, other: Any) -> StoredSettings:
        self.update(other)
        return self

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``dict.update``, then parsed on the next forward."""
        super().update(*args, **kwargs)
        self._edited()

    def setdefault(self, key: str, default: Any = None) -> Any:
        """``dict.setdefault``, then parsed on the next forward."""
        self._edited()
        return super().setdefault(key, default)

    def pop(self, *args: Any) -> Any:
        """``dict.pop``, then parsed on the next forward."""
        self._edited()
        return super().pop(*args)

    def popitem(self) -> tuple[str, Any]:
        """``dict.popitem``, then parsed on the next forward."""
        self._edited()
        return super().popitem()

    def clear(self) -> None:
        """``dict.clear``, then parsed on the next forward."""
        self._edited()
        super().clear()

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)


def settings_of(config: Any) -> tuple[ClusteredAttentionConfig, str]:
    """The patch settings of a model config: the config object ``convert`` stored, and the original."""
    stored = getattr(config, SETTINGS_KEY, None)
    if type(stored) is not StoredSettings:
        stored = _adopt(config, stored)
    return stored.parsed()


@torch.compiler.disable
def _adopt(config: Any, stored: Any) -> StoredSettings:
    """Give a reloaded checkpoint's plain dict of settings its object (it is parsed once, here)."""
    if not isinstance(stored, dict):
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} needs config.{SETTINGS_KEY}; "
            "use bert_cluster.convert(model)"
        )
    adopted = StoredSettings(stored)
    adopted.parsed()
    setattr(config, SETTINGS_KEY, adopted)
    return adopted


def layer_indices(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, int]]:
    """Each attention module's layer index, from the model's structure: its ``layer_idx``, else its position.

    Keyed by ``id(module)``; the same answer for a converted model and for its reloaded checkpoint.
    """
    indices = {}
    for position, module in enumerate(attention_modules(model)):
        index = getattr(module, "layer_idx", None)
        indices[id(module)] = (module, index if isinstance(index, int) else position)
    return indices


def _layer_index(module: torch.nn.Module) -> int:
    """The layer a module computes (set by ``convert``, or found from the running model on first call)."""
    index = getattr(module, "_bert_cluster_layer", None)
    if index is None:
        index = getattr(module, "layer_idx", None)
    if index is None:
        index = _index_from_running_model(module)
    return int(index)


@torch.compiler.disable
def _index_from_running_model(module: torch.nn.Module) -> int:
    """Index the modules of the model calling ``module`` (a checkpoint reloaded by ``from_pretrained``).

    Some families (DistilBERT, GTE, nomic-bert, Jina v3) give their attention modules no ``layer_idx``, and a
    reloaded model was not seen by ``convert``. The innermost ``PreTrainedModel`` running on this thread's
    call stack holds the module; its structure gives every index at once, under a lock.
    """
    from transformers import PreTrainedModel

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, PreTrainedModel):
            indices = layer_indices(owner)
            if id(module) in indices:
                with _index_lock:
                    for found, index in indices.values():
                        found._bert_cluster_layer = index
                return indices[id(module)][1]
        frame = frame.f_back
    raise RuntimeError(
        f"cannot tell which layer this {type(module).__name__} is: it was not called from a transformers "
        "model; call bert_cluster.convert(model) on the model that holds it"
    )


# --- the attention function --------------------------------------------------------------------------


def valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
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


def original_attention(module, original, query, key, value, attention_mask, half_window, kwargs):
    """Run a layer that is not patched as the unmodified model would: its implementation, its own mask."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        bidirectional_mask_function,
        sliding_window_bidirectional_mask_function,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if original == "eager":
        function = sys.modules[type(module).__module__].eager_attention_forward
    else:
        original = original if original in ALL_ATTENTION_FUNCTIONS else "sdpa"
        function = ALL_ATTENTION_FUNCTIONS[original]
    mask = attention_mask
    if attention_mask is None or attention_mask.dim() == 2:  # ours: rebuild the mask transformers would build
        mask = ALL_MASK_ATTENTION_FUNCTIONS[original](
            batch_size=query.shape[0],
            q_length=query.shape[-2],
            kv_length=key.shape[-2],
            mask_function=bidirectional_mask_function
            if half_window is None
            else sliding_window_bidirectional_mask_function(half_window),
            attention_mask=attention_mask,
            local_size=half_window,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=True,
            dtype=query.dtype,
            config=module.config,
            device=query.device,
        )
    return function(module, query, key, value, mask, **kwargs)


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
    """``AttentionInterface`` entry: q ``(B, H, L, D)``, k, v ``(B, Hkv, L, D)`` -> ``(B, L, H, D)``.

    A ``sliding_window`` keyword (flash convention: half window + 1) makes the layer a banded one.
    """
    config, original = settings_of(module.config)
    wants_weights = kwargs.get("output_attentions")
    if wants_weights is None:  # the config only when the call does not say (reading it costs microseconds)
        wants_weights = getattr(module.config, "output_attentions", False)
    if wants_weights:
        raise ValueError(
            "clustered attention computes no attention matrix: output_attentions is not supported "
            "(set it to False in the call and in model.config)"
        )
    window = kwargs.get("sliding_window")
    half_window = None if window is None else int(window) - 1
    layer = _layer_index(module)
    batch, heads, length, _ = query.shape
    if key.shape[-2] != length or (config.layers is not None and layer not in config.layers):
        return original_attention(
            module, original, query, key, value, attention_mask, half_window,
            {**kwargs, "scaling": scaling, "dropout": dropout},
        )  # fmt: skip
    if key.shape[1] != heads:  # grouped-query attention: each key/value head serves a group of query heads
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    valid = valid_from_mask(attention_mask, batch, length)
    if half_window is not None:
        out = windowed_attention(
            query, key, value, valid, half_window, config, scaling=scaling, dropout=dropout
        )
    else:
        out = clustered_attention(
            query, key, value, valid, config, scaling=scaling, layer=layer, dropout=dropout
        )
    # No copy for the CPU kernels' result, which is (B, L, H, D) memory already (SDPA's too).
    return out.transpose(1, 2).contiguous(), None


# --- which models qualify ----------------------------------------------------------------------------


@functools.cache
def _routes_through_interface(cls: type) -> bool:
    """Whether a module class looks its attention function up in transformers' ``ALL_ATTENTION_FUNCTIONS``."""
    if not issubclass(cls, torch.nn.Module) or cls.__module__.startswith("torch."):
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules that go through the interface, in layer order (a shared module appears once)."""
    return [module for module in model.modules() if _routes_through_interface(type(module))]


def _family(model: Any) -> str:
    return f"{getattr(model.config, 'model_type', None)!r} ({type(model).__name__})"


def check_model(model: Any) -> list[torch.nn.Module]:
    """The attention modules to patch, or the true reason why this model cannot be patched."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            "convert expects a transformers PreTrainedModel (e.g. from AutoModel.from_pretrained) or a "
            f"sentence_transformers.SentenceTransformer, got {type(model).__name__}"
        )
    family = _family(model)
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        raise ValueError(
            f"model family {family} is not a text encoder (it takes {model.main_input_name}); "
            "bert-cluster patches text encoders"
        )
    config = model.config
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(
            f"model family {family} is configured as a decoder (is_decoder / add_cross_attention); "
            "clustered attention replaces bidirectional self-attention only"
        )
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"model family {family} computes attention in its own code: none of its modules looks the "
            "implementation up in transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS), so clustered "
            "attention cannot be plugged in"
        )
    if any(getattr(module, "is_causal", False) for module in modules):
        raise ValueError(
            f"model family {family} is a decoder: its attention is causal (is_causal=True); clustered "
            "attention replaces bidirectional self-attention only"
        )
    return modules


def _check_layers(model: Any, modules: list[torch.nn.Module], layers: tuple[int, ...] | None) -> None:
    if layers is None:
        return
    family = _family(model)
    depth = getattr(model.config, "num_hidden_layers", None)
    if isinstance(depth, int) and len(modules) < depth:
        raise ValueError(
            f"model family {family} shares {len(modules)} attention module(s) across its {depth} layers, "
            "so layers cannot select among them: pass layers=None"
        )
    known = sorted(index for _, index in layer_indices(model).values())
    bad = [index for index in layers if index not in known]
    if bad:
        raise ValueError(f"layer index(es) {bad} out of range: this model has layers {known[0]}..{known[-1]}")


def _own_config(model: Any) -> None:
    """Give the model a config object of its own, so a config shared with another model stays untouched."""
    from transformers import PretrainedConfig

    memo: dict[int, Any] = {}
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                setattr(module, name, memo[id(value)])


def sentence_transformer_models(model: Any) -> list[Any] | None:
    """The transformers models inside a sentence-transformers model (None for anything else)."""
    if not isinstance(model, torch.nn.Module):
        return None
    if not type(model).__module__.startswith("sentence_transformers"):
        return None
    from transformers import PreTrainedModel

    found: list[Any] = []
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not any(module in outer.modules() for outer in found):
            found.append(module)
    if not found:
        raise TypeError(f"this {type(model).__name__} holds no transformers model to patch")
    return found


# --- the API -------------------------------------------------------------------------------------------


def convert(model: Any, config: ClusteredAttentionConfig | None = None, **settings: Any) -> Any:
    """Patch an encoder in place with (improved) clustered attention and return it.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through the ``AttentionInterface``
            (BERT, RoBERTa, DistilBERT, ELECTRA, ALBERT, XLM-R, CamemBERT, ModernBERT, nomic-bert, GTE,
            Jina v3, EuroBERT, ...), or a ``sentence_transformers.SentenceTransformer`` (its transformer
            module's model is patched).
        config: a ready ``ClusteredAttentionConfig``, instead of the keyword settings.
        settings: fields of ``ClusteredAttentionConfig`` to change from ``convert``'s preset,
            ``ClusteredAttentionConfig.for_convert()`` (clusters=25, topk=32, bits=63, iterations=10,
            mode="i-clustered+", min_length="auto", cluster_growth=0.5, topk_growth=0.5, seed=0,
            layers=None, backend="auto"). ``layers``: indices of the attention layers to patch (the
            model's layer numbers), or None for all; in hybrid models (ModernBERT) a selected
            sliding-window layer runs the exact band (``windowed_attention``), a selected global layer
            clustered attention; unselected layers keep the model's own implementation and mask.

    ``min_length`` is ``"auto"`` in this preset (0 in ``ClusteredAttentionConfig()`` and the evaluator's):
    rows too short for clustering to pay on this machine run torch's SDPA, so a converted model is never
    slower than the unmodified one; pass ``min_length=0`` to approximate every row longer than C.

    The model gets a config object of its own (a config shared with another model is left alone).
    Converting an already converted model replaces its settings; ``revert`` restores the implementation
    the model had before the first ``convert``.

    Raises:
        TypeError: an unknown setting name (the allowed ones are listed), a value of the wrong type, or
            ``config=`` together with keyword settings.
        ValueError: a value out of range, or a model that cannot be patched (the reason is given).
    """
    check_setting_names(settings)
    if config is None:
        layers = settings.get("layers")
        if isinstance(layers, Sized) and not isinstance(layers, (str, bytes)) and len(layers) == 0:
            raise ValueError("layers=[] patches no layer: pass None for all layers, or the indices to patch")
        config = ClusteredAttentionConfig.for_convert(**settings)
    elif not isinstance(config, ClusteredAttentionConfig):
        raise TypeError(
            "config must be a bert_cluster.ClusteredAttentionConfig (for a dict d: "
            f"ClusteredAttentionConfig.from_dict(d)), got {type(config).__name__}"
        )
    else:
        if settings:
            raise TypeError(
                f"pass either config= or keyword settings, not both (got config= and {sorted(settings)})"
            )
        if config.layers is not None and len(config.layers) == 0:
            raise ValueError("layers=() patches no layer: use None for all layers, or the indices to patch")
    inner = sentence_transformer_models(model)
    if inner is not None:
        for transformer in inner:
            convert(transformer, config=config)
        return model
    modules = check_model(model)
    _check_layers(model, modules, config.layers)

    register()
    previous = getattr(model.config, SETTINGS_KEY, None)
    current = model.config._attn_implementation
    original = previous.get("original_attn_implementation", "sdpa") if isinstance(previous, dict) else current
    _own_config(model)
    setattr(model.config, SETTINGS_KEY, StoredSettings.of(config, original or "sdpa"))
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        delattr(model.config, SETTINGS_KEY)
        raise ValueError(
            f"transformers did not switch model family {_family(model)} to {ATTENTION_NAME!r}: "
            "it does not let this model change its attention implementation"
        )
    model.config.attn_implementation = ATTENTION_NAME  # public: saved in config.json, read by from_pretrained
    for module, index in layer_indices(model).values():
        module._bert_cluster_layer = index
    if model.config.model_type not in TESTED_FAMILIES:
        logger.warning(
            "model family %s routes its attention through the AttentionInterface, so it was converted, "
            "but bert-cluster's tests do not cover it",
            _family(model),
        )
    return model


def revert(model: Any) -> Any:
    """Switch a converted model back to the attention implementation it had before ``convert``."""
    inner = sentence_transformer_models(model)
    if inner is not None:
        for transformer in inner:
            revert(transformer)
        return model
    settings = getattr(getattr(model, "config", None), SETTINGS_KEY, None)
    if not isinstance(settings, dict):
        raise ValueError("this model was not converted by bert_cluster (no config.clustered_attention)")
    original = settings.get("original_attn_implementation", "sdpa")
    model.set_attn_implementation(original)
    delattr(model.config, SETTINGS_KEY)
    if hasattr(model.config, "attn_implementation"):
        delattr(model.config, "attn_implementation")
    for module in attention_modules(model):
        if hasattr(module, "_bert_cluster_layer"):
            del module._bert_cluster_layer
    return model
