"""``clustered_attention``: the one place where the paper's steps are composed.

Routing by algorithm lives here: rows too short for clustering to pay run torch's own SDPA over their
valid keys only; every other row runs the paper's steps with the cluster count and top-k its length
calls for (``ClusteredAttentionConfig.row_settings``). The choice of backend (reference, CPU or CUDA
kernels) lives in ``bert_cluster.dispatch``.

The routing reads each row's valid length on the host once per forward pass, not once per layer: the
plan is cached for the same ``valid`` tensor (transformers hands every layer the same mask), and the
hash planes are cached on the device they are used on.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import math
import threading
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from bert_cluster import environment
from bert_cluster.config import (
    AUTO,
    ClusteredAttentionConfig,
    RowSettings,
    check_config,
    config_of,
    number_of,
)

if TYPE_CHECKING:  # the backends import the ops, which `import bert_cluster` must not load
    from bert_cluster.dispatch import Backend

_GOLDEN = 0x9E3779B97F4A7C15  # mixes (seed, layer) into distinct generator seeds


@functools.lru_cache(maxsize=256)
def _cpu_planes(seed: int, layer: int, bits: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed * _GOLDEN + layer) % (2**63))
    # Cached across calls: must not be inference tensors, or a later autograd forward could not use them.
    with torch.inference_mode(False):
        planes = torch.randn(bits, head_dim, generator=generator, dtype=torch.float32)
        offsets = torch.randn(bits, generator=generator, dtype=torch.float32)
    return planes, offsets


@functools.lru_cache(maxsize=256)
def _device_planes(
    seed: int, layer: int, bits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    planes, offsets = _cpu_planes(seed, layer, bits, head_dim)
    with torch.inference_mode(False):  # one host-to-device copy per (layer, device), not one per call
        return planes.to(device), offsets.to(device)


def hash_planes(
    seed: int, layer: int, bits: int, head_dim: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random hyperplanes ``(B, Dk)`` and offsets ``(B,)`` of one layer.

    Drawn on the CPU from a generator seeded with ``(seed, layer)``, so that every backend and device
    hashes with identical bits and each layer has its own stream. Shared by all heads of the layer;
    cached on each device they are used on.
    """
    return _device_planes(seed, layer, bits, head_dim, torch.device(device))


#: What runs in place of the paper's steps (``replaced_steps``); None: the steps themselves.
_replacement: Any = None


@contextlib.contextmanager
def replaced_steps(steps: Any) -> collections.abc.Iterator[None]:
    """Within the block, every clustered row runs ``steps`` in place of the paper's steps: a research hook.

    ``steps(backend, query, key, value, valid, config, clusters, topk, scaling, layer)`` gets what the
    steps get (rows longer than ``clusters``, the chosen backend, the row's C and k, the layer) and returns
    the attention output; short rows still run exact attention. For the whole process, not one thread;
    inference only (attention dropout is refused). ``benchmarks.fidelity_screen`` screens candidate steps
    through it.
    """
    global _replacement
    before, _replacement = _replacement, steps
    try:
        yield
    finally:
        _replacement = before


def _check_inputs(query, key, value, valid, name: str) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"{name} expects self-attention tensors query/key (R, H, N, Dk) and value (R, H, N, Dv); "
            f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"query and key must have the same head dim, got {query.shape[-1]} and {key.shape[-1]}"
        )
    if key.shape[:-1] != query.shape[:-1] or value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"{name} expects self-attention tensors query/key (R, H, N, Dk) and value (R, H, N, Dv); "
            f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[-1] == 0:
        raise ValueError(
            f"{name}: the head dim Dk must be at least 1, got query {tuple(query.shape)} (no scaling "
            "1/sqrt(Dk) and nothing to hash); rows, heads and tokens may be 0 (an empty result)"
        )
    rows, _, length, _ = query.shape
    if valid is not None and (valid.shape != (rows, length) or valid.dtype != torch.bool):
        raise ValueError(
            f"valid must be a bool tensor of shape {(rows, length)}, got {valid.dtype} {tuple(valid.shape)}"
        )


def clustered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None = None,
    config: ClusteredAttentionConfig | None = None,
    *,
    scaling: float | None = None,
    layer: int = 0,
    dropout: float = 0.0,
) -> torch.Tensor:
    """(Improved) clustered self-attention.

    Args:
        query, key, value: ``(R, H, N, Dk)``, ``(R, H, N, Dk)``, ``(R, H, N, Dv)``, fp32/fp16/bf16.
        valid: bool ``(R, N)``, False on padding (left, right or anywhere); None means no padding.
        config: the settings; defaults to ``ClusteredAttentionConfig()`` (i-clustered, C=25, k=32).
        scaling: softmax temperature, ``1/sqrt(Dk)`` by default.
        layer: the layer index, which selects this layer's stream of random hash planes.
        dropout: attention dropout probability (training; transformers passes 0 in eval): the centroids'
            weights are dropped per (centroid, key), each query's top-k weights per (query, key) and short
            rows' weights as in exact attention. The masks come from one draw of torch's default generator
            (``dropout_seed``).

    Returns:
        ``(R, H, N, Dv)`` in the input dtype. Short rows (at most C valid tokens, or fewer than
        ``config.min_length``) get exact attention through torch's SDPA over their valid keys. Padded
        query positions get zeros; padding never influences a valid output, and NaN/inf in valid inputs
        or in ``scaling`` propagate to the outputs they touch (``bert_cluster.reference`` states the rules).
        R, H or N of 0 gives an empty result, as SDPA does; a head dim Dk of 0 is a ``ValueError``.
        On the CPU the result is usually a view of ``(R, N, H, Dv)`` memory, as CPU SDPA's is (the layout
        transformers takes attention's output in): ``.contiguous()`` gives ``(R, H, N, Dv)`` memory.
    """
    config = check_config(config, "clustered_attention")
    _check_inputs(query, key, value, valid, "clustered_attention")
    rows, _, length, head_dim = query.shape
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    dropout = _check_dropout(dropout)
    if query.shape[:-1].numel() == 0:  # no rows, heads or tokens: an empty result, as SDPA gives
        return query.new_zeros(*query.shape[:-1], value.shape[-1])
    seed = dropout_seed() if dropout else 0
    if torch.compiler.is_compiling():
        # One opaque op for torch.compile: the routing below is data-dependent (a graph break otherwise).
        if valid is None:
            valid = torch.ones(rows, length, dtype=torch.bool, device=query.device)
        number = number_of(config)  # the op takes the config as its number (config.number_of)
        return _clustered_attention_op(query, key, value, valid, number, scaling, layer, dropout, seed)
    return _route(query, key, value, valid, config, scaling, layer, dropout, seed)


def _check_dropout(dropout: float) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__} {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1) (a probability; 1 drops every weight), got {dropout}")
    return float(dropout)


def dropout_seed() -> int:
    """One draw from torch's default generator: the seed of a call's dropout masks.

    Drawn once per call, so that ``torch.manual_seed`` fixes every mask, and passed on as a number, so that
    a forward computed again for the backward (torch.compile's op, gradient checkpointing) drops the
    same weights. The masks themselves are hashes of the seed and the weights' positions
    (``reference.dropout_uniforms``).
    """
    return int(torch.randint(0, 2**62, (1,)).item())


def _part_seed(seed: int, part: int) -> int:
    """The seed of one part of a call (a group of rows, the short rows): its row numbers are its own."""
    return (seed + part * _GOLDEN) % 2**62


# --- routing ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which backend and which rows go where, decided once per (valid mask, settings, shapes)."""

    backend: Backend
    short: list[int]  # rows for exact attention
    short_lengths: list[int]  # their valid lengths
    short_prefix: bool  # every short row's valid tokens are a prefix (right padding or none)
    groups: list[tuple[list[int], int, int]]  # (rows, clusters, topk) for the clustered rows
    rows: int
    device: torch.device
    _indices: dict = dataclasses.field(default_factory=dict, compare=False)

    def index(self, rows: list[int]) -> torch.Tensor:
        """The rows as an index tensor on the device, made once per plan."""
        key = tuple(rows)
        if key not in self._indices:
            self._indices[key] = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self._indices[key]


_PLANS: dict = {}
_PLANS_LOCK = threading.Lock()
_PLANS_KEPT = 16


def _plan(query, key, value, valid, config, scaling, dropout=0.0) -> _Plan:
    """The routing plan, from a cache keyed on the very ``valid`` tensor (and its in-place version).

    Everything the backend choice reads is in the key (devices, dtypes, whether autograd records, whether
    attention dropout is asked, the backend environment variables), so each layer of a forward pass reuses
    the first layer's plan.
    """
    rows, heads, length, head_dim = query.shape
    records = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    variables = environment.backend_key()
    facts = (rows, length, heads, head_dim, value.shape[-1], query.dtype, query.device, records, dropout > 0)
    facts += (variables,)
    # Inference tensors carry no version counter: a mask edited in place under inference_mode keeps
    # its plan (transformers builds a new mask tensor for every forward pass).
    version = None if valid is None or valid.is_inference() else valid._version
    # The config by value (its hash is computed once per object): equal configs share a plan, such as the
    # new config object per call that torch.compile's op builds. The mask by identity, checked below so
    # that a reused id never returns another tensor's plan.
    cache_key = (None if valid is None else (id(valid), version), facts, config)
    cached = _PLANS.get(cache_key)
    if cached is not None and (cached[0] is None or cached[0]() is valid):
        return cached[1]
    plan = _make_plan(query, key, value, valid, config, scaling, dropout)
    with _PLANS_LOCK:
        _PLANS[cache_key] = (None if valid is None else weakref.ref(valid), plan)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)), None)  # the oldest
    return plan


def _make_plan(query, key, value, valid, config, scaling, dropout) -> _Plan:
    from bert_cluster import dispatch  # lazy: keeps `import bert_cluster` free of kernel loading

    backend = dispatch.select_backend(config.backend, query, key, value, dropout=dropout)
    rows, _, length, _ = query.shape
    if valid is None:
        lengths, prefix = [length] * rows, [True] * rows
    else:
        # The one host synchronisation of a forward pass: lengths and layouts of every row, together.
        count = valid.sum(-1)
        is_prefix = (valid == (torch.arange(length, device=valid.device) < count[:, None])).all(-1)
        facts = torch.stack([count, is_prefix.long()]).tolist()
        lengths, prefix = facts[0], [bool(p) for p in facts[1]]
    settings = [config.row_settings(n) for n in lengths]
    long_rows = [r for r in range(rows) if lengths[r] > settings[r].clusters]
    min_length = config.min_length
    if min_length == AUTO:
        min_length = 0
        if long_rows:
            from bert_cluster import crossover

            min_length = crossover.min_length(backend, query, key, value, config, scaling, _clustered)
    long_rows = [r for r in long_rows if lengths[r] >= min_length]
    clustered = set(long_rows)
    short = [r for r in range(rows) if r not in clustered]
    groups: dict[RowSettings, list[int]] = {}
    for r in long_rows:
        groups.setdefault(settings[r], []).append(r)
    return _Plan(
        backend=backend,
        short=short,
        short_lengths=[lengths[r] for r in short],
        short_prefix=all(prefix[r] for r in short),
        groups=[(members, c, k) for (c, k), members in groups.items()],
        rows=rows,
        device=query.device,
    )


def _route(query, key, value, valid, config, scaling, layer, dropout=0.0, seed=0) -> torch.Tensor:
    """Short rows to SDPA, the rest through the paper's steps on the chosen backend, per row settings."""
    plan = _plan(query, key, value, valid, config, scaling, dropout)
    backend = plan.backend
    rows, _, length, _ = query.shape

    def drop(part: int) -> dict:
        return {"dropout": dropout, "seed": _part_seed(seed, part)}

    if valid is None and plan.groups:
        valid = torch.ones(rows, length, dtype=torch.bool, device=query.device)

    def part(tensor, members):
        return tensor if len(members) == rows else tensor.index_select(0, plan.index(members))

    if len(plan.short) == rows:
        return exact_rows(query, key, value, valid, plan.short_lengths, plan.short_prefix, scaling, **drop(0))
    if len(plan.groups) == 1 and not plan.short:
        _, clusters, topk = plan.groups[0]
        out = _clustered(backend, query, key, value, valid, config, clusters, topk, scaling, layer, **drop(1))
        return out.to(query.dtype)
    # (R, N, H, Dv) memory, as the fused op writes it: transformers' layout (see hf.attention_forward).
    out = torch.empty(rows, length, query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device)
    out = out.transpose(1, 2)
    for group, (members, clusters, topk) in enumerate(plan.groups, start=1):
        q, k, v, ok = (part(t, members) for t in (query, key, value, valid))
        result = _clustered(backend, q, k, v, ok, config, clusters, topk, scaling, layer, **drop(group))
        out = out.index_copy(0, plan.index(members), result.to(query.dtype))
    if plan.short:
        q, k, v = (part(t, plan.short) for t in (query, key, value))
        ok = None if valid is None else part(valid, plan.short)
        result = exact_rows(q, k, v, ok, plan.short_lengths, plan.short_prefix, scaling, **drop(0))
        out = out.index_copy(0, plan.index(plan.short), result)
    return out


def exact_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    lengths: list[int],
    prefix: bool,
    scaling: float,
    dropout: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """Exact attention through torch's SDPA over each row's valid keys only, in the input dtype.

    ``lengths`` are the rows' valid counts (on the host); ``prefix`` says every row's valid tokens come
    first (right padding), so that slicing replaces gathering. Rows are packed to the longest valid length
    L: the work is at most (rows x L x L), never the padded N x N, and padded positions are zeroed
    before SDPA sees them (an attention mask alone would still let ``nan`` through: ``nan + -inf``).
    Padded queries get zeros. With ``dropout`` (training), the masks are ``seed``'s, by position.
    """
    rows, heads, length, _ = query.shape
    longest = max(lengths, default=0)
    if valid is None or min(lengths, default=length) == length:  # no padding (or no rows)
        return _sdpa(query, key, value, None, scaling, dropout, seed, None)
    out_shape = (rows, heads, length, value.shape[-1])
    if longest == 0:
        return query.new_zeros(out_shape)
    if prefix:
        q, k, v = (t[:, :, :longest] for t in (query, key, value))
        kept = valid[:, :longest]
        order = None
    else:
        # Valid positions first, in order (a stable sort of the padding flags), then the padding.
        order = torch.sort((~valid).byte(), dim=-1, stable=True).indices[:, :longest]
        kept = valid.gather(1, order)
        q, k, v = (
            t.gather(2, order[:, None, :, None].expand(-1, heads, -1, t.shape[-1]))
            for t in (query, key, value)
        )
    mask = None
    if min(lengths) < longest:  # rows of several lengths: mask each row's padding inside the pack
        keep = kept[:, None, :, None]
        q, k, v = (torch.where(keep, t, 0) for t in (q, k, v))
        mask = kept[:, None, None, :]
    packed = _sdpa(q, k, v, mask, scaling, dropout, seed, order)
    if mask is not None:
        packed = torch.where(keep, packed, 0)
    if order is None:  # right padding: the padded tail gets zeros
        return torch.nn.functional.pad(packed, (0, 0, 0, length - longest))
    index = order[:, None, :, None].expand(-1, heads, -1, packed.shape[-1])
    return query.new_zeros(out_shape).scatter(2, index, packed)


def _sdpa(query, key, value, mask, scaling, dropout, seed, positions) -> torch.Tensor:
    """SDPA; with dropout, the same product written out, its mask ``seed``'s by position.

    (SDPA's own dropout draws from torch's default generator, which a forward computed again for the
    backward could not repeat: ``dropout_seed``.) ``positions`` ``(R, L)``: the packed tokens' positions
    in the row (None: 0..L-1).
    """
    if not dropout:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(query, key, value, attn_mask=mask, scale=scaling)
    from bert_cluster import reference

    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if mask is not None:  # a row with no valid key keeps finite scores (its queries are zeroed after)
        scores = scores.masked_fill(~mask & mask.any(-1, keepdim=True), -math.inf)
    if positions is None:
        positions = torch.arange(query.shape[2], device=query.device)
    else:
        positions = positions[:, None, :]  # (R, 1, L): broadcast over heads
    weights = torch.softmax(scores, dim=-1)
    weights = reference.attention_dropout(
        weights, dropout, seed, positions[..., :, None], positions[..., None, :]
    )
    return torch.matmul(weights.to(value.dtype), value)


def windowed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    window: int,
    config: ClusteredAttentionConfig | None = None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Exact attention inside a band of ``window`` positions on each side (sliding-window layers).

    Same layout and padding rules as ``clustered_attention``; O(N * window) on every backend
    (``reference.banded_attention`` and the ``banded_attention`` op), where SDPA under a band mask costs N^2.
    ``dropout`` (training) drops the band's weights (the CPU kernels draw the reference's masks from the
    call's seed).
    """
    from bert_cluster import dispatch

    dropout = _check_dropout(dropout)
    config = check_config(config, "windowed_attention")
    _check_inputs(query, key, value, valid, "windowed_attention")
    rows, _, length, head_dim = query.shape
    if valid is None:
        valid = torch.ones(rows, length, dtype=torch.bool, device=query.device)
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    backend = dispatch.select_backend(config.backend, query, key, value, dropout=dropout)
    if not dropout:
        return backend.banded_attention(query, key, value, valid, int(window), scaling).to(query.dtype)
    q, k, v = _widened_for_dropout(backend, query, key, value)
    out = backend.banded_attention(q, k, v, valid, int(window), scaling, dropout, dropout_seed())
    return out.to(query.dtype)


# --- torch.compile: the whole routing as one opaque op -------------------------------------------------


@torch.library.custom_op("bert_cluster::clustered_attention", mutates_args=())
def _clustered_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    config: int,
    scaling: float,
    layer: int,
    dropout: float,
    dropout_seed: int,
) -> torch.Tensor:
    """``clustered_attention`` as one opaque op, which is what torch.compile sees.

    ``config``: the settings' number (``config.number_of``: an op takes numbers, not objects), which gives
    a config object back as it is (no dict, nothing built anew). Defined at import (a Python op: no library
    is loaded) because dynamo cannot trace its definition. Its backward (registered below) is another
    opaque op, so a compiled training step works too.
    """
    settings = config_of(config)
    return _transformers_layout(
        _route(query, key, value, valid, settings, scaling, layer, dropout, dropout_seed)
    )


@_clustered_attention_op.register_fake
def _(query, key, value, valid, *settings):
    rows, heads, length = query.shape[:-1]
    return query.new_empty((rows, length, heads, value.shape[-1])).transpose(1, 2)


def _transformers_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``(R, H, N, D)`` on ``(R, N, H, D)`` memory, the layout the compiled op promises its callers.

    The fused CPU op and CPU SDPA give that already (no copy); other paths are copied into it once.
    """
    rows, heads, length, dims = out.shape
    if out.stride() == (length * heads * dims, dims, heads * dims, 1):
        return out
    return out.new_empty((rows, length, heads, dims)).transpose(1, 2).copy_(out)


@torch.library.custom_op("bert_cluster::clustered_attention_backward", mutates_args=())
def _clustered_attention_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    config: int,
    scaling: float,
    layer: int,
    dropout: float,
    dropout_seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``_clustered_attention_op``: its forward again, eagerly, and the steps' backward.

    Opaque to torch.compile as the forward is (the routing reads the mask on the host), so a compiled
    training step recomputes the attention in its backward, as gradient checkpointing would (with the
    forward's dropout masks: they come from ``dropout_seed``).
    """
    from bert_cluster import ops  # lazy: keeps `import bert_cluster` free of kernel loading

    settings = config_of(config)
    # The recomputed forward's steps record autograd, whose registered backwards then give the gradient.
    with ops.autograd_inside_an_op():
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        out = _route(*leaves, valid, settings, scaling, layer, dropout, dropout_seed)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True))


@_clustered_attention_backward_op.register_fake
def _(grad, query, key, value, valid, *settings):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _save_attention_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.settings = inputs[4:]


def _attention_backward(ctx, grad):
    query, key, value, valid = ctx.saved_tensors
    grads = _clustered_attention_backward_op(grad, query, key, value, valid, *ctx.settings)
    return (*grads, *([None] * (1 + len(ctx.settings))))


_clustered_attention_op.register_autograd(_attention_backward, setup_context=_save_attention_inputs)


# --- the paper's steps -------------------------------------------------------------------------------


def _clustered(
    backend: Backend, query, key, value, valid, config, clusters, topk, scaling, layer, dropout=0.0, seed=0
) -> torch.Tensor:
    """The paper's steps on rows that are all longer than ``clusters``: float32 output.

    A backend with a ``clustered_heads`` op (the CPU kernels) runs them all in one call, with the same
    result as the steps one by one (``composed_heads``). With attention dropout, ``dropped``.
    """
    if _replacement is not None:
        if dropout:
            raise ValueError("steps replaced by attention.replaced_steps run without attention dropout")
        return _replacement(backend, query, key, value, valid, config, clusters, topk, scaling, layer)
    planes, offsets, *settings = step_arguments(config, clusters, topk, scaling, layer, query)
    if dropout:
        return dropped(backend, query, key, value, valid, planes, offsets, *settings, dropout, seed)
    records = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if not records:
        if backend.clustered_heads is not None:
            return backend.clustered_heads(query, key, value, valid, planes, offsets, *settings)
        return _composed(backend, query, key, value, valid, planes, offsets, *settings)
    if backend.name == "reference":  # the oracle: autograd through its functions
        return _composed(backend, query, key, value, valid, planes, offsets, *settings)
    return _StepsWithBackward.apply(query, key, value, valid, backend, planes, offsets, *settings)


class _StepsWithBackward(torch.autograd.Function):
    """A recording pass on a kernel backend: the steps as one autograd node, their backwards chained.

    The forward is the inference forward, keeping its partition (assignments, centroids and the centroids'
    attention: O(N + C * k) per head): the fused op's variant that returns it where the backend has one,
    the composed steps elsewhere. The backward is ``ops.clustered_steps_backward``: autograd's gradient
    through the composed ops, bit for bit in float32, without seven nodes' bookkeeping per call and with
    each gradient summed in place.
    """

    @staticmethod
    def forward(ctx, queries, keys, values, valid, backend, planes, offsets, *settings):
        settings = StepSettings(*settings)
        fused = backend.clustered_heads_partition
        if fused is not None:
            out, *kept = fused(queries, keys, values, valid, planes, offsets, *settings)
        else:
            p = partition(backend, queries, keys, values, valid, planes, offsets, *settings)
            out = refined(backend, queries, keys, values, valid, p, settings)
            kept = [p.assignments, p.centroids, p.centroid_values, p.topk_indices, p.topk_mass, p.topk_values]
        ctx.save_for_backward(queries, keys, values, valid, *kept)
        ctx.settings = settings
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from bert_cluster import ops  # lazy: keeps `import bert_cluster` free of kernel loading

        saved = ctx.saved_tensors
        found = ops.clustered_steps_backward(grad_out, *saved, ctx.settings.mode, ctx.settings.scaling)
        needed = ctx.needs_input_grad
        grads = [grad.to(saved[i].dtype) if needed[i] else None for i, grad in enumerate(found)]
        return (*grads, *([None] * (len(needed) - 3)))


class StepSettings(NamedTuple):
    """The settings of the steps of one call: the arguments after the tensors of ``clustered_heads``.

    In the op's order, so ``*settings`` passes them on; ``clusters`` and ``topk`` are the row settings
    (``ClusteredAttentionConfig.row_settings``), ``lloyd_rounds`` mode "i-clustered+"'s.
    """

    clusters: int
    topk: int
    iterations: int
    mode: str
    lloyd_rounds: int
    scaling: float

    @property
    def computes(self) -> Any:
        """What the mode computes (a ``steps.Mode``)."""
        return _computes(self.mode)


def _computes(mode: str) -> Any:
    """What ``mode`` computes: its row of ``steps.MODES``."""
    from bert_cluster import steps  # lazy: `import bert_cluster` stays as lean as it is

    return steps.MODES[mode]


def step_arguments(
    config: ClusteredAttentionConfig,
    clusters: int,
    topk: int,
    scaling: float,
    layer: int,
    query: torch.Tensor,
) -> tuple:
    """``(planes, offsets, *StepSettings)``: the arguments after the tensors of ``clustered_heads``.

    For rows of ``query``'s head dim and device, with the row settings ``clusters`` and ``topk``
    (``config.row_settings``).
    """
    planes, offsets = hash_planes(config.seed, layer, config.bits, query.shape[-1], query.device)
    rounds = plus_lloyd_rounds(clusters) if _computes(config.mode).lloyd else 0
    return planes, offsets, *StepSettings(clusters, topk, config.iterations, config.mode, rounds, scaling)


@dataclasses.dataclass(frozen=True)
class Partition:
    """What the steps before the last one give: the clusters, their attention and their top-k keys.

    ``assignments`` ``(R, H, N)``, ``centroids`` ``(R, H, C, Dk)``, ``counts`` ``(R, H, C)``, then
    ``centroid_attention``'s four outputs (``topk_indices`` ``(R, H, C, k)``, k = 0 without top-k).
    """

    assignments: torch.Tensor
    centroids: torch.Tensor
    counts: torch.Tensor
    centroid_values: torch.Tensor
    topk_indices: torch.Tensor
    topk_mass: torch.Tensor
    topk_values: torch.Tensor


def partition(
    backend: Backend,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    planes: torch.Tensor,
    offsets: torch.Tensor,
    clusters: int,
    topk: int,
    iterations: int,
    mode: str,
    lloyd_rounds: int,
    scaling: float,
) -> Partition:
    """The steps of ``mode`` up to the centroids' attention, on ``backend`` (what inspection measures)."""
    computes = StepSettings(clusters, topk, iterations, mode, lloyd_rounds, scaling).computes
    hashes = backend.hash_queries(queries, planes, offsets)
    assignments, _ = backend.hamming_kmeans(hashes, valid, clusters, iterations, planes.shape[0])
    if computes.lloyd:
        assignments, centroids, counts = backend.lloyd_refine(queries, assignments, clusters, lloyd_rounds)
    else:
        centroids, counts = backend.group_queries(queries, assignments, clusters)
    attended = backend.centroid_attention(
        centroids, keys, values, valid, topk if computes.uses_topk else 0, scaling
    )
    return Partition(assignments, centroids, counts, *attended)


def _composed(backend: Backend, queries, keys, values, valid, planes, offsets, *settings) -> torch.Tensor:
    """The steps one by one on ``backend``, as the ``clustered_heads`` op runs them fused."""
    p = partition(backend, queries, keys, values, valid, planes, offsets, *settings)
    return refined(backend, queries, keys, values, valid, p, StepSettings(*settings))


def refined(
    backend: Backend,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    p: Partition,
    settings: StepSettings,
    dropout: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """The mode's last step: each query's output from its cluster's row (and its top-k keys).

    With ``dropout``, ``p.centroid_values`` are the centroids' dropped rows outside the top-k
    (``centroid_rest``) and ``p.topk_values`` zeros (``dropped``).
    """
    computes = settings.computes
    if not computes.uses_topk:
        return backend.broadcast_clusters(p.centroid_values, p.assignments)
    if computes.query_mass:
        return backend.refine_with_query_mass(
            queries, keys, values, valid, p.assignments, p.centroids, p.centroid_values, p.topk_indices,
            p.topk_mass, p.topk_values, settings.scaling, dropout, seed,
        )  # fmt: skip
    return backend.topk_refine(
        queries, keys, values, p.assignments, p.centroid_values, p.topk_indices, p.topk_mass, p.topk_values,
        settings.scaling, dropout, seed,
    )  # fmt: skip


def _widened_for_dropout(backend: Backend, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The CPU kernels' dropout reads float32 contiguous rows: widened once per call, not once per step."""
    return tensors if backend.name != "cpu" else tuple(t.float().contiguous() for t in tensors)


def dropped(
    backend: Backend, queries, keys, values, valid, planes, offsets, *settings_and_dropout
) -> torch.Tensor:
    """The steps with attention dropout (training), every step on ``backend``.

    The clusters and their top-k keys are chosen as without dropout. The centroids' attention over the
    other keys is dropped per (centroid, key) (``centroid_rest``, one C x N pass per head) and each query's
    top-k weights per (query, key) (the refinement with ``dropout`` and ``seed``): on the CPU kernels, with
    the reference's masks drawn in place from the seed (their backward draws them again); elsewhere the
    reference, through autograd.
    """
    *settings, dropout, seed = settings_and_dropout
    settings = StepSettings(*settings)
    p = partition(backend, queries, keys, values, valid, planes, offsets, *settings)
    queries, keys, values = _widened_for_dropout(backend, queries, keys, values)
    scaling = settings.scaling
    rest = backend.centroid_rest(p.centroids, keys, values, valid, p.topk_indices, scaling, dropout, seed)
    # The top-k part is left out of ``rest`` already.
    p = dataclasses.replace(p, centroid_values=rest, topk_values=torch.zeros_like(rest))
    if not settings.computes.uses_topk:
        return backend.broadcast_clusters(rest, p.assignments)
    return refined(backend, queries, keys, values, valid, p, settings, dropout, seed)


def composed_heads(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    planes: torch.Tensor,
    offsets: torch.Tensor,
    clusters: int,
    topk: int,
    iterations: int,
    mode: str,
    lloyd_rounds: int,
    scaling: float,
) -> torch.Tensor:
    """The reference of the fused ``clustered_heads`` op: its steps one by one in ``bert_cluster.reference``.

    Same arguments as the op; float32 ``(R, H, N, Dv)``.
    """
    from bert_cluster import dispatch  # lazy: keeps `import bert_cluster` free of kernel loading

    settings = StepSettings(clusters, topk, iterations, mode, lloyd_rounds, scaling)
    return _composed(dispatch.ReferenceBackend(), queries, keys, values, valid, planes, offsets, *settings)


def composed_heads_partition(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    planes: torch.Tensor,
    offsets: torch.Tensor,
    clusters: int,
    topk: int,
    iterations: int,
    mode: str,
    lloyd_rounds: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of ``clustered_heads_partition``: ``composed_heads``' output and the partition it used.

    Same arguments as ``clustered_heads``; ``(out, assignments, centroids, centroid_values, topk_indices,
    topk_mass, topk_values)``.
    """
    from bert_cluster import dispatch  # lazy: keeps `import bert_cluster` free of kernel loading

    backend = dispatch.ReferenceBackend()
    settings = StepSettings(clusters, topk, iterations, mode, lloyd_rounds, scaling)
    p = partition(backend, queries, keys, values, valid, planes, offsets, *settings)
    out = refined(backend, queries, keys, values, valid, p, settings)
    return out, p.assignments, p.centroids, p.centroid_values, p.topk_indices, p.topk_mass, p.topk_values


# i-clustered+ (issue 13): i-clustered on a partition refined in the queries' own space, with
# each query's own share of attention on the exactly recomputed keys.

#: Mode "i-clustered+" spends about one round of N x 25 query-centroid distances per head on Lloyd's
#: K-means over the real query vectors: ceil(25 / C) rounds, at most 3. A round costs in proportion to C,
#: and a small C leaves the Hamming partition coarser, so C >= 25 gets one round (at C = 25 one round
#: scored as well as three on the held-out SQuAD half, for a third of the cost) and C = 10 three (one
#: round lost 2.6 F1 there on one seed, three 1.7; README "Fidelity").
PLUS_LLOYD_WORK = 25
PLUS_MAX_LLOYD_ROUNDS = 3


def plus_lloyd_rounds(clusters: int) -> int:
    """Lloyd rounds of mode "i-clustered+" at ``clusters`` clusters (see ``PLUS_LLOYD_WORK``)."""
    return min(PLUS_MAX_LLOYD_ROUNDS, -(-PLUS_LLOYD_WORK // max(int(clusters), 1)))
