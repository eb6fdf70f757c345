"""``clustered_attention``: the one place where the paper's steps are composed.

Routing by algorithm lives here (short rows use exact attention); the choice of backend (reference,
CPU or CUDA kernels) lives in ``bert_cluster.dispatch``.
"""

from __future__ import annotations

import functools
import math

import torch

from bert_cluster.config import ClusteredAttentionConfig

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


def hash_planes(
    seed: int, layer: int, bits: int, head_dim: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random hyperplanes ``(B, Dk)`` and offsets ``(B,)`` of one layer.

    Drawn on the CPU from a generator seeded with ``(seed, layer)``, so that every backend and device
    hashes with identical bits and each layer has its own stream. Shared by all heads of the layer.
    """
    planes, offsets = _cpu_planes(seed, layer, bits, head_dim)
    return planes.to(device), offsets.to(device)


def clustered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None = None,
    config: ClusteredAttentionConfig | None = None,
    *,
    scaling: float | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """(Improved) clustered self-attention.

    Args:
        query, key, value: ``(R, H, N, Dk)``, ``(R, H, N, Dk)``, ``(R, H, N, Dv)``, fp32/fp16/bf16.
        valid: bool ``(R, N)``, False on padding (left, right or anywhere); None means no padding.
        config: the settings; defaults to ``ClusteredAttentionConfig()`` (i-clustered, C=25, k=32).
        scaling: softmax temperature, ``1/sqrt(Dk)`` by default.
        layer: the layer index, which selects this layer's stream of random hash planes.

    Returns:
        ``(R, H, N, Dv)`` in the input dtype. Rows with at most C valid tokens (or fewer than
        ``config.min_length``) get exact attention. Padded query positions get zeros.
    """
    config = config or ClusteredAttentionConfig()
    if query.dim() != 4 or key.shape[:-1] != query.shape[:-1] or value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            "clustered_attention expects self-attention tensors query/key (R, H, N, Dk) and value "
            f"(R, H, N, Dv); got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    rows, _, length, head_dim = query.shape
    if valid is None:
        valid = torch.ones(rows, length, dtype=torch.bool, device=query.device)
    elif valid.shape != (rows, length) or valid.dtype != torch.bool:
        raise ValueError(
            f"valid must be a bool tensor of shape {(rows, length)}, got {valid.dtype} {tuple(valid.shape)}"
        )
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    if torch.compiler.is_compiling():
        # One opaque op for torch.compile: the routing below is data-dependent (a graph break otherwise).
        return _clustered_attention_op(query, key, value, valid, *_config_args(config), scaling, layer)
    return _route(query, key, value, valid, config, scaling, layer)


def _route(query, key, value, valid, config, scaling, layer) -> torch.Tensor:
    """Short rows to exact attention, the rest through the paper's steps, on the chosen backend."""
    from bert_cluster import dispatch  # lazy: keeps `import bert_cluster` free of kernel loading

    backend = dispatch.select_backend(config.backend, query, key, value)
    lengths = valid.sum(-1)
    short = (lengths <= config.clusters) | (lengths < config.min_length)
    if bool(short.all()):
        out = backend.exact_attention(query, key, value, valid, scaling)
        return out.to(query.dtype)
    if not bool(short.any()):
        return _clustered(backend, query, key, value, valid, config, scaling, layer).to(query.dtype)
    out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=torch.float32, device=query.device)
    s, c = short.nonzero().squeeze(-1), (~short).nonzero().squeeze(-1)
    out[s] = backend.exact_attention(query[s], key[s], value[s], valid[s], scaling)
    out[c] = _clustered(backend, query[c], key[c], value[c], valid[c], config, scaling, layer)
    return out.to(query.dtype)


def windowed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    window: int,
    config: ClusteredAttentionConfig | None = None,
    *,
    scaling: float | None = None,
) -> torch.Tensor:
    """Exact attention inside a band of ``window`` positions on each side (sliding-window layers).

    Same layout and padding rules as ``clustered_attention``; O(N * window) on every backend
    (``reference.banded_attention`` and the ``banded_attention`` op), where SDPA under a band mask costs N^2.
    """
    from bert_cluster import dispatch

    config = config or ClusteredAttentionConfig()
    rows, _, length, head_dim = query.shape
    if valid is None:
        valid = torch.ones(rows, length, dtype=torch.bool, device=query.device)
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    backend = dispatch.select_backend(config.backend, query, key, value)
    return backend.banded_attention(query, key, value, valid, int(window), scaling).to(query.dtype)


_CONFIG_FIELDS = ("clusters", "topk", "bits", "iterations", "mode", "min_length", "seed", "backend")


def _config_args(config: ClusteredAttentionConfig) -> tuple:
    return tuple(getattr(config, name) for name in _CONFIG_FIELDS)


@torch.library.custom_op("bert_cluster::clustered_attention", mutates_args=())
def _clustered_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    clusters: int,
    topk: int,
    bits: int,
    iterations: int,
    mode: str,
    min_length: int,
    seed: int,
    backend: str,
    scaling: float,
    layer: int,
) -> torch.Tensor:
    """``clustered_attention`` as one opaque op, which is what torch.compile sees.

    Defined at import (a Python op: no library is loaded) because dynamo cannot trace its definition.
    Forward only: compiling a patched model is for inference; eager training uses the reference path.
    """
    values = (clusters, topk, bits, iterations, mode, min_length, seed, backend)
    config = ClusteredAttentionConfig(**dict(zip(_CONFIG_FIELDS, values, strict=True)))
    return _route(query, key, value, valid, config, scaling, layer)


@_clustered_attention_op.register_fake
def _(query, key, value, valid, *settings):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _clustered(backend, query, key, value, valid, config, scaling, layer) -> torch.Tensor:
    """The paper's steps on rows that are all longer than C: float32 output."""
    planes, offsets = hash_planes(config.seed, layer, config.bits, query.shape[-1], query.device)
    hashes = backend.hash_queries(query, planes, offsets)
    assignments, _ = backend.hamming_kmeans(hashes, valid, config.clusters, config.iterations, config.bits)
    if config.mode == "i-clustered+":
        return _clustered_plus(backend, query, key, value, valid, assignments, config, scaling)
    centroids, _ = backend.group_queries(query, assignments, config.clusters)
    refine = config.mode == "i-clustered"
    centroid_values, topk_indices, topk_mass, topk_values = backend.centroid_attention(
        centroids, key, value, valid, config.topk if refine else 0, scaling
    )
    if not refine:
        return backend.broadcast_clusters(centroid_values, assignments)
    return backend.topk_refine(
        query, key, value, assignments, centroid_values, topk_indices, topk_mass, topk_values, scaling
    )


# i-clustered+ (issue 13; w4-fidelity): i-clustered on a partition refined in the queries' own space, with
# each query's own share of attention on the exactly recomputed keys.

#: Lloyd rounds on the real query vectors after the Hamming K-means, in mode "i-clustered+".
PLUS_LLOYD_ITERATIONS = 3


def _clustered_plus(backend, query, key, value, valid, assignments, config, scaling) -> torch.Tensor:
    """i-clustered+: Lloyd rounds on the Hamming partition, then top-k refinement with per-query mass."""
    assignments, centroids, _ = backend.lloyd_refine(
        query, assignments, config.clusters, PLUS_LLOYD_ITERATIONS
    )
    centroid_values, topk_indices, topk_mass, topk_values = backend.centroid_attention(
        centroids, key, value, valid, config.topk, scaling
    )
    return backend.refine_with_query_mass(
        query,
        key,
        value,
        valid,
        assignments,
        centroids,
        centroid_values,
        topk_indices,
        topk_mass,
        topk_values,
        scaling,
    )
