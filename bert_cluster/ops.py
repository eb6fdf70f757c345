"""The ``bert_cluster`` op schemas, their fake (meta) kernels and typed wrappers: the only C++ bridge.

The schemas are defined here, in Python, from the table of steps (``bert_cluster.steps``), so that they
exist (and ``torch.compile`` can trace them through the fake kernels) whether or not ``bert_cluster._C``
was built. ``kernels/cpu/*.cpp`` and
``kernels/cuda/*.cu`` only register implementations for these names. Each op has the name, argument
order and output shapes of the matching function in ``bert_cluster.reference``.

This module is imported lazily (by the kernel backends in ``bert_cluster.dispatch``), never by
``import bert_cluster``. Import order, with no circle: ``environment`` <- ``_loader`` (imports ``_C``)
<- ``ops`` (schemas, then ``_C``) <- ``dispatch`` (availability) <- ``_build`` (build facts, the driver).
"""

from __future__ import annotations

import torch

from bert_cluster import _loader, steps

NAMESPACE = "bert_cluster"

#: op name -> schema (arguments after the name) of the ops every kernel backend compiles (steps.py's table).
SCHEMAS: dict[str, str] = {
    step.name: step.schema for step in steps.STEPS if step.schema and step.compiled == steps.KERNEL_BACKENDS
}
#: op name -> schema of the ops ``_C`` implements for the CPU only.
CPU_ONLY_SCHEMAS: dict[str, str] = {
    step.name: step.schema for step in steps.STEPS if step.schema and step.compiled == ("cpu",)
}

_LIB = torch.library.Library(NAMESPACE, "DEF")
for _step in steps.STEPS:
    if _step.schema is not None:
        _LIB.define(_step.name + _step.schema)


# ---------------------------------------------------------------------------------------------------
# Fake kernels: shapes and dtypes only (what torch.compile and opcheck trace with).


@torch.library.register_fake(f"{NAMESPACE}::hash_queries")
def _hash_queries_fake(queries, planes, offsets):
    return queries.new_empty(queries.shape[:-1], dtype=torch.int64)


@torch.library.register_fake(f"{NAMESPACE}::hamming_kmeans")
def _hamming_kmeans_fake(hashes, valid, clusters, iterations, bits):
    rows, heads, _ = hashes.shape
    return hashes.new_empty(hashes.shape, dtype=torch.int64), hashes.new_empty(
        (rows, heads, clusters), dtype=torch.int64
    )


@torch.library.register_fake(f"{NAMESPACE}::group_queries")
def _group_queries_fake(queries, assignments, clusters):
    rows, heads, _, dk = queries.shape
    return (
        queries.new_empty((rows, heads, clusters, dk), dtype=torch.float32),
        queries.new_empty((rows, heads, clusters), dtype=torch.float32),
    )


@torch.library.register_fake(f"{NAMESPACE}::centroid_attention")
def _centroid_attention_fake(centroids, keys, values, valid, topk, scaling):
    rows, heads, clusters, _ = centroids.shape
    dv = values.shape[-1]
    k = torch.sym_min(topk, keys.shape[-2])
    return (
        centroids.new_empty((rows, heads, clusters, dv), dtype=torch.float32),
        centroids.new_empty((rows, heads, clusters, k), dtype=torch.int64),
        centroids.new_empty((rows, heads, clusters), dtype=torch.float32),
        centroids.new_empty((rows, heads, clusters, dv), dtype=torch.float32),
    )


@torch.library.register_fake(f"{NAMESPACE}::topk_refine")
def _topk_refine_fake(
    queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values, scaling
):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::broadcast_clusters")
def _broadcast_clusters_fake(centroid_values, assignments):
    return centroid_values.new_empty((*assignments.shape, centroid_values.shape[-1]))


@torch.library.register_fake(f"{NAMESPACE}::banded_attention")
def _banded_attention_fake(queries, keys, values, valid, window, scaling):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Typed wrappers (same signatures as bert_cluster.reference).

_ops = getattr(torch.ops, NAMESPACE)
_loaded = [False]  # whether _loader.load() ran: the CPU/CUDA implementations register when _C loads


def load_kernels() -> dict:
    """Import ``bert_cluster._C`` (once, after the schemas above exist); the loader's state."""
    state = _loader.load(first_use=_build_cpu_kernels)
    _loaded[0] = True
    return state


def _build_cpu_kernels() -> dict:
    """The CPU kernels built for this torch (``_cpu_jit``): the prebuilt ones are for another release."""
    from bert_cluster import _cpu_jit

    return _cpu_jit.build()


def missing_kernels(dispatch_key: str) -> list[str]:
    """The ops the table compiles for ``dispatch_key``'s backend with no ``_C`` kernel registered for it.

    Asked on every dispatch, so the answer is kept with the loader's state (registrations happen at load).
    """
    cache = load_kernels().setdefault("missing_kernels", {})
    if dispatch_key not in cache:
        compiled = steps.compiled_by(dispatch_key.lower())
        required = tuple(op for op in compiled if op not in PENDING_KERNELS)
        cache[dispatch_key] = [op for op in required if not _loader.has_kernel(op, dispatch_key)]
    return list(cache[dispatch_key])


def _ensure_loaded() -> None:
    if not _loaded[0]:
        load_kernels()


def hash_queries(queries: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """See ``reference.hash_queries``: int64 ``(R, H, N)`` hashes."""
    _ensure_loaded()
    return _ops.hash_queries.default(queries, planes, offsets)


def hamming_kmeans(
    hashes: torch.Tensor, valid: torch.Tensor, clusters: int, iterations: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.hamming_kmeans``: assignments ``(R, H, N)`` and centroid hashes ``(R, H, C)``."""
    _ensure_loaded()
    return _ops.hamming_kmeans.default(hashes, valid, clusters, iterations, bits)


def group_queries(
    queries: torch.Tensor, assignments: torch.Tensor, clusters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.group_queries``: float32 centroids ``(R, H, C, Dk)`` and counts ``(R, H, C)``."""
    _ensure_loaded()
    return _ops.group_queries.default(queries, assignments, clusters)


def centroid_attention(
    centroids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    topk: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.centroid_attention``: ``(Vc, topk_indices, topk_mass, topk_values)``."""
    _ensure_loaded()
    return _ops.centroid_attention.default(centroids, keys, values, valid, topk, float(scaling))


def topk_refine(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    assignments: torch.Tensor,
    centroid_values: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_mass: torch.Tensor,
    topk_values: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """See ``reference.topk_refine``: float32 ``(R, H, N, Dv)``."""
    _ensure_loaded()
    return _ops.topk_refine.default(
        queries,
        keys,
        values,
        assignments,
        centroid_values,
        topk_indices,
        topk_mass,
        topk_values,
        float(scaling),
    )


def broadcast_clusters(centroid_values: torch.Tensor, assignments: torch.Tensor) -> torch.Tensor:
    """See ``reference.broadcast_clusters``: ``(R, H, N, Dv)`` in ``centroid_values``' dtype."""
    _ensure_loaded()
    return _ops.broadcast_clusters.default(centroid_values, assignments)


def banded_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    window: int,
    scaling: float,
) -> torch.Tensor:
    """See ``reference.banded_attention``: float32 ``(R, H, N, Dv)``, keys within ``window`` positions."""
    _ensure_loaded()
    return _ops.banded_attention.default(queries, keys, values, valid, window, float(scaling))


OPS = tuple(SCHEMAS)
#: The ops whose compiled implementation is still to come: the kernel backends run the reference for them
#: and the kernel backends do not require them from ``_C``. Empty: kernels/ implements every op.
PENDING_KERNELS: frozenset[str] = frozenset()
#: The ops ``_C`` must register (per device) for a kernel backend to count as available.
KERNEL_OPS = tuple(op for op in OPS if op not in PENDING_KERNELS)


# ---------------------------------------------------------------------------------------------------
# i-clustered+ (issue 13; w4-fidelity): Lloyd rounds on the real query vectors, and refinement with each
# query's own top-k mass. Fakes and wrappers. Compiled for the CPU only: they are not in ``OPS`` (the ops
# every kernel backend needs on every device); the CPU backend needs them too, the CUDA backend runs the
# reference for them.


@torch.library.register_fake(f"{NAMESPACE}::lloyd_refine")
def _lloyd_refine_fake(queries, assignments, clusters, iterations):
    rows, heads, n, dk = queries.shape
    return (
        queries.new_empty((rows, heads, n), dtype=torch.int64),
        queries.new_empty((rows, heads, clusters, dk), dtype=torch.float32),
        queries.new_empty((rows, heads, clusters), dtype=torch.float32),
    )


def lloyd_refine(
    queries: torch.Tensor, assignments: torch.Tensor, clusters: int, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.lloyd_refine``: assignments ``(R, H, N)``, centroids ``(R, H, C, Dk)``, counts."""
    _ensure_loaded()
    return _ops.lloyd_refine.default(queries, assignments, clusters, iterations)


@torch.library.register_fake(f"{NAMESPACE}::refine_with_query_mass")
def _refine_with_query_mass_fake(
    queries,
    keys,
    values,
    valid,
    assignments,
    centroids,
    centroid_values,
    topk_indices,
    topk_mass,
    topk_values,
    scaling,
):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


def refine_with_query_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    assignments: torch.Tensor,
    centroids: torch.Tensor,
    centroid_values: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_mass: torch.Tensor,
    topk_values: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """See ``reference.refine_with_query_mass``: float32 ``(R, H, N, Dv)``."""
    _ensure_loaded()
    return _ops.refine_with_query_mass.default(
        queries,
        keys,
        values,
        valid,
        assignments,
        centroids,
        centroid_values,
        topk_indices,
        topk_mass,
        topk_values,
        float(scaling),
    )


# Every step of one attention call as one op (kernels/cpu/pipeline.cpp): the steps above, run per (row, head)
# in one parallel region, with their results bit for bit. attention.composed_heads composes the same steps
# one by one on the backends that lack it.


@torch.library.register_fake(f"{NAMESPACE}::clustered_heads")
def _clustered_heads_fake(
    queries, keys, values, valid, planes, offsets, clusters, topk, iterations, mode, lloyd_rounds, scaling
):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


def clustered_heads(
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
    """Hashing to refinement in one op (see ``attention._clustered``): float32 ``(R, H, N, Dv)``."""
    _ensure_loaded()
    return _ops.clustered_heads.default(
        queries,
        keys,
        values,
        valid,
        planes,
        offsets,
        int(clusters),
        int(topk),
        int(iterations),
        mode,
        int(lloyd_rounds),
        float(scaling),
    )


CPU_ONLY_OPS = tuple(CPU_ONLY_SCHEMAS)
