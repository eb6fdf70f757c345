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

import contextlib

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
CPU_ONLY_OPS = tuple(CPU_ONLY_SCHEMAS)


# ---------------------------------------------------------------------------------------------------
# i-clustered+ (issue 13; w4-fidelity): Lloyd rounds on the real query vectors, and refinement with each
# query's own top-k mass. Fakes and wrappers. Compiled for the CPU and CUDA (kernels/cpu/lloyd.cpp,
# query_mass.cpp; kernels/cuda/plus.cu), so in ``OPS``.


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
    # The kernel writes (R, N, H, Dv) memory, transformers' layout, and returns it as an (R, H, N, Dv) view.
    rows, heads, length = queries.shape[:-1]
    return queries.new_empty((rows, length, heads, values.shape[-1]), dtype=torch.float32).transpose(1, 2)


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
    """Hashing to refinement in one op (see ``attention._clustered``): float32 ``(R, H, N, Dv)``.

    The result is a view of ``(R, N, H, Dv)`` memory (``.transpose(1, 2)`` of it is contiguous): the layout
    transformers takes attention's output in, so handing it over costs no copy.
    """
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


@torch.library.register_fake(f"{NAMESPACE}::clustered_heads_partition")
def _clustered_heads_partition_fake(
    queries, keys, values, valid, planes, offsets, clusters, topk, iterations, mode, lloyd_rounds, scaling
):
    rows, heads, length, dk = queries.shape
    dv, k = values.shape[-1], 0 if mode == "clustered" else min(topk, length)
    small = (rows, heads, clusters)
    return (
        _clustered_heads_fake(queries, keys, values, valid, planes, offsets, clusters, topk, iterations, mode,
                              lloyd_rounds, scaling),
        queries.new_empty((rows, heads, length), dtype=torch.long),
        queries.new_empty((*small, dk), dtype=torch.float32),
        queries.new_empty((*small, dv), dtype=torch.float32),
        queries.new_empty((*small, k), dtype=torch.long),
        queries.new_empty(small, dtype=torch.float32),
        queries.new_empty((*small, dv), dtype=torch.float32),
    )  # fmt: skip


def clustered_heads_partition(*args) -> tuple[torch.Tensor, ...]:
    """``clustered_heads`` and the partition it used (what a recording pass keeps for the backward).

    ``(out, assignments, centroids, centroid_values, topk_indices, topk_mass, topk_values)``, the last six
    as the separate steps give them (``attention.Partition``).
    """
    _ensure_loaded()
    return _ops.clustered_heads_partition.default(*args)


# ---------------------------------------------------------------------------------------------------
# Backward (issue 38): the gradient of each differentiable op is the gradient of its reference function
# given the discrete choices its forward made (assignments, top-k indices), which carry none; steps.py says
# how each op's is computed (``Step.backward``). The refinements have backward ops (CPU kernels); for the
# other steps the backward recomputes the step's smooth part in PyTorch (O(N * (C + k)) per head, never
# N x N) and differentiates it. Hashing and K-means have integer outputs only.


# The refinements' backward as ops: the kernels (kernels/cpu/backward.cpp, kernels/cuda/backward.cu and
# plus.cu) where they are built, and elsewhere (a build without kernels, another device) the gradient of
# the reference function, registered for every other device as a composite. Inputs float32 and contiguous
# (the autograd formulas below cast), except topk_refine_backward's queries, keys and values: read in their
# dtype and layout, as the forward.


@torch.library.register_fake(f"{NAMESPACE}::topk_refine_backward")
def _topk_refine_backward_fake(
    grad_out, queries, keys, values, assignments, topk_indices, topk_mass, scaling
):
    rows, heads, clusters, _ = topk_indices.shape
    centroid_grad = values.new_empty((rows, heads, clusters, values.shape[-1]))
    return (
        torch.empty_like(queries, dtype=torch.float32),
        torch.empty_like(keys, dtype=torch.float32),
        torch.empty_like(values, dtype=torch.float32),
        centroid_grad,
        topk_mass.new_empty(topk_mass.shape),
        torch.empty_like(centroid_grad),
    )


@torch.library.register_fake(f"{NAMESPACE}::refine_with_query_mass_backward")
def _refine_with_query_mass_backward_fake(
    grad_out, queries, keys, values, valid, assignments, centroids, *rest
):
    centroid_values, _, topk_mass, topk_values, _ = rest
    return tuple(
        torch.empty_like(t)
        for t in (queries, keys, values, centroids, centroid_values, topk_mass, topk_values)
    )


@torch.library.register_fake(f"{NAMESPACE}::centroid_attention_backward")
def _centroid_attention_backward_fake(
    grad_centroid_values,
    grad_topk_mass,
    grad_topk_values,
    centroids,
    keys,
    values,
    valid,
    topk_indices,
    scaling,
):
    return torch.empty_like(centroids), torch.empty_like(keys), torch.empty_like(values)


@torch.library.register_fake(f"{NAMESPACE}::centroid_attention_backward_into")
def _centroid_attention_backward_into_fake(grad_keys, grad_values, *rest):
    return torch.empty_like(rest[3], dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::group_queries_backward")
def _group_queries_backward_fake(grad_centroids, queries, assignments):
    return torch.empty_like(queries)


@torch.library.register_fake(f"{NAMESPACE}::broadcast_clusters_backward")
def _broadcast_clusters_backward_fake(grad_out, centroid_values, assignments):
    return torch.empty_like(centroid_values)


@torch.library.register_fake(f"{NAMESPACE}::banded_attention_backward")
def _banded_attention_backward_fake(grad_out, queries, keys, values, valid, window, scaling):
    return tuple(torch.empty_like(t, dtype=torch.float32) for t in (queries, keys, values))


@contextlib.contextmanager
def autograd_inside_an_op():
    """Autograd recording inside an op's implementation, which the dispatcher runs below autograd.

    A backward that differentiates the reference (or recomputes a forward) with autograd needs it: the
    autograd dispatch keys are let back in, and grad mode is on.
    """
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        excluded = excluded.remove(getattr(torch._C.DispatchKey, name))
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded), torch.enable_grad():
        yield


# Where no backward kernel is registered (a build without kernels, another device): the reference's gradient.
def _register_reference_backwards() -> None:
    def in_op(function):
        def call(*args):
            with autograd_inside_an_op():
                return function(*args)

        return call

    for step in steps.STEPS:
        if step.schema and "_backward" in step.name:
            torch.library.impl(
                f"{NAMESPACE}::{step.name}",
                "CompositeExplicitAutograd",
                in_op(step.reference_function()),
                lib=_LIB,
            )


_register_reference_backwards()


def topk_refine_backward(
    grad_out: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    assignments: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_mass: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.topk_refine_backward``: float32 gradients of q, k, v, Vc, mass and Vtop."""
    _ensure_loaded()
    return _ops.topk_refine_backward.default(
        grad_out, queries, keys, values, assignments, topk_indices, topk_mass, float(scaling)
    )


def refine_with_query_mass_backward(
    grad_out: torch.Tensor,
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
) -> tuple[torch.Tensor, ...]:
    """See ``reference.refine_with_query_mass_backward``: float32 gradients (q, k, v, c, Vc, m, Vtop)."""
    _ensure_loaded()
    return _ops.refine_with_query_mass_backward.default(
        grad_out, queries, keys, values, valid, assignments, centroids, centroid_values, topk_indices,
        topk_mass, topk_values, float(scaling),
    )  # fmt: skip


def centroid_attention_backward(
    grad_centroid_values: torch.Tensor,
    grad_topk_mass: torch.Tensor,
    grad_topk_values: torch.Tensor,
    centroids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    topk_indices: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.centroid_attention_backward``: gradients of centroids, keys and values."""
    _ensure_loaded()
    return _ops.centroid_attention_backward.default(
        grad_centroid_values, grad_topk_mass, grad_topk_values, centroids, keys, values, valid,
        topk_indices, float(scaling),
    )  # fmt: skip


def centroid_attention_backward_into(
    grad_keys: torch.Tensor,
    grad_values: torch.Tensor,
    grad_centroid_values: torch.Tensor,
    grad_topk_mass: torch.Tensor,
    grad_topk_values: torch.Tensor,
    centroids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    topk_indices: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """See ``reference.centroid_attention_backward_into``: adds into the first two, returns the centroids'."""
    _ensure_loaded()
    return _ops.centroid_attention_backward_into.default(
        grad_keys, grad_values, grad_centroid_values, grad_topk_mass, grad_topk_values, centroids, keys,
        values, valid, topk_indices, float(scaling),
    )  # fmt: skip


def group_queries_backward(
    grad_centroids: torch.Tensor, queries: torch.Tensor, assignments: torch.Tensor
) -> torch.Tensor:
    """See ``reference.group_queries_backward``: the queries' gradient, in their dtype."""
    _ensure_loaded()
    return _ops.group_queries_backward.default(grad_centroids, queries, assignments)


def broadcast_clusters_backward(
    grad_out: torch.Tensor, centroid_values: torch.Tensor, assignments: torch.Tensor
) -> torch.Tensor:
    """See ``reference.broadcast_clusters_backward``: the centroid values' gradient."""
    _ensure_loaded()
    return _ops.broadcast_clusters_backward.default(grad_out, centroid_values, assignments)


def banded_attention_backward(
    grad_out: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    window: int,
    scaling: float,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.banded_attention_backward``: float32 gradients of queries, keys and values."""
    _ensure_loaded()
    return _ops.banded_attention_backward.default(
        grad_out, queries, keys, values, valid, int(window), float(scaling)
    )


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().contiguous()


def _wide_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, as the refinements' backward kernels read it.

    The CPU kernels read rows through their strides: a float32 tensor in transformers' (B, L, H, D) memory
    is not copied. The other devices' kernels take it contiguous.
    """
    tensor = tensor.float()
    return tensor if tensor.device.type == "cpu" and tensor.stride(-1) == 1 else tensor.contiguous()


def _topk_refine_gradient(
    grads, queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values, scaling
):
    found = topk_refine_backward(  # q, k, v read in their dtype and layout (no widened copies)
        _wide_rows(grads[0]),
        queries,
        keys,
        values,
        assignments.contiguous(),
        topk_indices.contiguous(),
        _wide(topk_mass),
        float(scaling),
    )
    dq, dk, dv, dvc, dmass, dtopv = found
    return [dq, dk, dv, None, dvc, None, dmass, dtopv, None]


def _refine_with_query_mass_gradient(
    grads,
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
    found = refine_with_query_mass_backward(
        _wide_rows(grads[0]),
        _wide_rows(queries),
        _wide_rows(keys),
        _wide_rows(values),
        valid.contiguous(),
        assignments.contiguous(),
        _wide(centroids),
        _wide(centroid_values),
        topk_indices.contiguous(),
        _wide(topk_mass),
        _wide(topk_values),
        float(scaling),
    )
    dq, dk, dv, dc, dvc, dmass, dtopv = found
    return [dq, dk, dv, None, None, dc, dvc, None, dmass, dtopv, None]


def _centroid_attention_gradient(grads, centroids, keys, values, valid, topk, scaling, indices):
    g_vc, _, g_mass, g_topv = grads
    rows, heads, clusters, _ = centroids.shape
    small = (rows, heads, clusters)
    g_vc = centroids.new_zeros((*small, values.shape[-1]), dtype=torch.float32) if g_vc is None else g_vc
    found = centroid_attention_backward(
        _wide(g_vc),
        centroids.new_zeros(small, dtype=torch.float32) if g_mass is None else _wide(g_mass),
        torch.zeros_like(g_vc, dtype=torch.float32) if g_topv is None else _wide(g_topv),
        _wide(centroids),
        keys,
        values,
        valid.contiguous(),
        indices.contiguous(),
        float(scaling),
    )
    return [*found, None, None, None]


def _means_gradient(grad_centroids, queries, assignments):
    """The queries' gradient from the cluster means' (group_queries, lloyd_refine's final partition)."""
    if grad_centroids is None:
        return torch.zeros_like(queries)
    return group_queries_backward(_wide(grad_centroids), queries, assignments.contiguous())


def _broadcast_gradient(grads, centroid_values, assignments):
    grad = grads[0].to(centroid_values.dtype)
    return [broadcast_clusters_backward(grad, centroid_values, assignments.contiguous()), None]


def clustered_steps_backward(
    grad_out: torch.Tensor,
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
    mode: str,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries', keys' and values' gradients (float32) of one clustered call, given its partition.

    The backwards the steps' ops register, chained by hand in the order autograd would run them: the
    refinement's (or the broadcast's), the centroid attention's (adding its key and value gradients into
    the refinement's: no second N-row tensor per head at the backward's peak), the cluster means'. Each
    sum has two terms, so the bits are autograd's through the composed ops in float32 (a + b = b + a);
    in fp16/bf16 the parts are summed in float32 and rounded once (autograd rounds each part first).
    """
    g_centroids = None
    if mode == "clustered":
        g_vc = broadcast_clusters_backward(_wide(grad_out), centroid_values, assignments.contiguous())
        g_mass = g_topv = None
        dq = dk = dv = None
    elif mode == "i-clustered+":
        found = _refine_with_query_mass_gradient(
            (grad_out,), queries, keys, values, valid, assignments, centroids, centroid_values,
            topk_indices, topk_mass, topk_values, scaling,
        )  # fmt: skip
        dq, dk, dv, _, _, g_centroids, g_vc, _, g_mass, g_topv, _ = found
    else:
        found = _topk_refine_gradient(
            (grad_out,), queries, keys, values, assignments, centroid_values, topk_indices, topk_mass,
            topk_values, scaling,
        )  # fmt: skip
        dq, dk, dv, _, g_vc, _, g_mass, g_topv, _ = found
    del grad_out
    small = centroids.shape[:3]
    if dk is None:  # mode clustered: the centroid attention's are the only key and value gradients
        dk = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        dv = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    g_attention = centroid_attention_backward_into(
        dk,
        dv,
        _wide(g_vc),
        centroids.new_zeros(small, dtype=torch.float32) if g_mass is None else _wide(g_mass),
        torch.zeros_like(g_vc, dtype=torch.float32) if g_topv is None else _wide(g_topv),
        _wide(centroids),
        keys,
        values,
        valid.contiguous(),
        topk_indices.contiguous(),
        float(scaling),
    )
    del g_vc, g_mass, g_topv
    g_centroids = g_attention if g_centroids is None else g_centroids.add_(g_attention)
    del g_attention
    dq_means = _means_gradient(g_centroids, queries, assignments)
    dq = dq_means if dq is None else dq.add_(dq_means)
    return dq, dk, dv


def _register_gradient(op: str, gradient, kept_outputs: tuple[int, ...] = ()) -> None:
    """Register ``gradient(grads, *inputs, *kept)`` (a gradient per input, None where none) as the backward.

    ``kept``: the forward's outputs named by ``kept_outputs`` (its discrete choices), saved with the inputs.
    """

    def setup_context(ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        kept = [outputs[i] for i in kept_outputs]
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)], *kept)
        ctx.constants = [None if isinstance(t, torch.Tensor) else t for t in inputs]

    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors)
        inputs = [next(tensors) if constant is None else constant for constant in ctx.constants]
        found = gradient(grads, *inputs, *tensors)
        return tuple(
            None if grad is None or not ctx.needs_input_grad[i] else grad.to(inputs[i].dtype)
            for i, grad in enumerate(found)
        )

    torch.library.register_autograd(f"{NAMESPACE}::{op}", backward, setup_context=setup_context)


def _register_backwards() -> None:

    # group_queries(queries, assignments, clusters) -> (centroids, counts)
    _register_gradient("group_queries", lambda g, q, a, c: [_means_gradient(g[0], q, a), None, None])
    # lloyd_refine(queries, assignments, clusters, iterations) -> (assignments, centroids, counts): the
    # centroids are the means of the final partition (output 0), as group_queries gives them.
    _register_gradient(
        "lloyd_refine",
        lambda g, q, a, c, rounds, final: [_means_gradient(g[1], q, final), None, None, None],
        kept_outputs=(0,),
    )
    # centroid_attention(centroids, keys, values, valid, topk, scaling) -> (Vc, indices, mass, topv), given
    # the top-k choice (output 1).
    _register_gradient("centroid_attention", _centroid_attention_gradient, kept_outputs=(1,))
    # The refinements.
    _register_gradient("topk_refine", _topk_refine_gradient)
    _register_gradient("refine_with_query_mass", _refine_with_query_mass_gradient)
    # broadcast_clusters(Vc, assignments) -> out
    _register_gradient("broadcast_clusters", _broadcast_gradient)
    # banded_attention(queries, keys, values, valid, window, scaling) -> out
    _register_gradient(
        "banded_attention",
        lambda g, q, k, v, valid, window, scaling: [
            *banded_attention_backward(_wide(g[0]), q, k, v, valid.contiguous(), window, scaling),
            None, None, None,
        ],
    )  # fmt: skip


_register_backwards()


# ---------------------------------------------------------------------------------------------------
# Attention dropout in training (issue 38, item 2): the dropout ops (kernels/cpu/dropout.cpp on the CPU,
# the reference elsewhere). Their inputs are float32 and contiguous (``_wide``: no copy when they are
# already); each backward draws the forward's masks again from its seed, so only the inputs are saved.


@torch.library.register_fake(f"{NAMESPACE}::centroid_rest")
def _centroid_rest_fake(centroids, keys, values, valid, topk_indices, scaling, dropout, seed):
    return centroids.new_empty((*centroids.shape[:-1], values.shape[-1]), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::topk_refine_dropout")
def _topk_refine_dropout_fake(queries, keys, values, *rest):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::refine_with_query_mass_dropout")
def _refine_with_query_mass_dropout_fake(queries, keys, values, *rest):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::banded_attention_dropout")
def _banded_attention_dropout_fake(queries, keys, values, valid, window, scaling, dropout, seed):
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::centroid_rest_backward")
def _centroid_rest_backward_fake(grad_rest, centroids, keys, values, *rest):
    return tuple(torch.empty_like(t, dtype=torch.float32) for t in (centroids, keys, values))


@torch.library.register_fake(f"{NAMESPACE}::topk_refine_dropout_backward")
def _topk_refine_dropout_backward_fake(
    grad_out, queries, keys, values, assignments, topk_indices, topk_mass, *rest
):
    return _topk_refine_backward_fake(
        grad_out, queries, keys, values, assignments, topk_indices, topk_mass, 1.0
    )


@torch.library.register_fake(f"{NAMESPACE}::refine_with_query_mass_dropout_backward")
def _refine_with_query_mass_dropout_backward_fake(grad_out, queries, keys, values, valid, assignments, *rest):
    centroids, centroid_values, _, topk_mass, topk_values = rest[:5]
    return tuple(
        torch.empty_like(t, dtype=torch.float32)
        for t in (queries, keys, values, centroids, centroid_values, topk_mass, topk_values)
    )


@torch.library.register_fake(f"{NAMESPACE}::banded_attention_dropout_backward")
def _banded_attention_dropout_backward_fake(grad_out, queries, keys, values, *rest):
    return tuple(torch.empty_like(t, dtype=torch.float32) for t in (queries, keys, values))


def centroid_rest(
    centroids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    topk_indices: torch.Tensor,
    scaling: float,
    dropout: float,
    seed: int,
) -> torch.Tensor:
    """See ``reference.centroid_rest``: float32 ``(R, H, C, Dv)``, the dropped attention outside the top-k."""
    _ensure_loaded()
    return _ops.centroid_rest.default(
        _wide(centroids), _wide(keys), _wide(values), valid.contiguous(), topk_indices.contiguous(),
        float(scaling), float(dropout), int(seed),
    )  # fmt: skip


def topk_refine_dropout(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    assignments: torch.Tensor,
    centroid_values: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_mass: torch.Tensor,
    topk_values: torch.Tensor,
    scaling: float,
    dropout: float,
    seed: int,
) -> torch.Tensor:
    """See ``reference.topk_refine`` (with ``dropout``, ``seed``): float32 ``(R, H, N, Dv)``."""
    _ensure_loaded()
    return _ops.topk_refine_dropout.default(
        _wide(queries), _wide(keys), _wide(values), assignments.contiguous(), _wide(centroid_values),
        topk_indices.contiguous(), _wide(topk_mass), _wide(topk_values), float(scaling), float(dropout),
        int(seed),
    )  # fmt: skip


def refine_with_query_mass_dropout(
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
    dropout: float,
    seed: int,
) -> torch.Tensor:
    """See ``reference.refine_with_query_mass`` (with ``dropout``, ``seed``): float32 ``(R, H, N, Dv)``."""
    _ensure_loaded()
    return _ops.refine_with_query_mass_dropout.default(
        _wide(queries), _wide(keys), _wide(values), valid.contiguous(), assignments.contiguous(),
        _wide(centroids), _wide(centroid_values), topk_indices.contiguous(), _wide(topk_mass),
        _wide(topk_values), float(scaling), float(dropout), int(seed),
    )  # fmt: skip


def banded_attention_dropout(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    window: int,
    scaling: float,
    dropout: float,
    seed: int,
) -> torch.Tensor:
    """See ``reference.banded_attention`` (with ``dropout``, ``seed``): float32 ``(R, H, N, Dv)``."""
    _ensure_loaded()
    return _ops.banded_attention_dropout.default(
        _wide(queries), _wide(keys), _wide(values), valid.contiguous(), int(window), float(scaling),
        float(dropout), int(seed),
    )  # fmt: skip


def centroid_rest_backward(
    grad_rest: torch.Tensor,
    centroids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    topk_indices: torch.Tensor,
    scaling: float,
    dropout: float,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.centroid_rest_backward``: float32 gradients of centroids, keys and values."""
    _ensure_loaded()
    return _ops.centroid_rest_backward.default(
        _wide(grad_rest), _wide(centroids), _wide(keys), _wide(values), valid.contiguous(),
        topk_indices.contiguous(), float(scaling), float(dropout), int(seed),
    )  # fmt: skip


def topk_refine_dropout_backward(
    grad_out: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    assignments: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_mass: torch.Tensor,
    scaling: float,
    dropout: float,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.topk_refine_dropout_backward``: float32 gradients of q, k, v, Vc, mass and Vtop."""
    _ensure_loaded()
    return _ops.topk_refine_dropout_backward.default(
        _wide(grad_out), _wide(queries), _wide(keys), _wide(values), assignments.contiguous(),
        topk_indices.contiguous(), _wide(topk_mass), float(scaling), float(dropout), int(seed),
    )  # fmt: skip


def refine_with_query_mass_dropout_backward(
    grad_out: torch.Tensor,
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
    dropout: float,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.refine_with_query_mass_dropout_backward``: gradients (q, k, v, c, Vc, m, Vtop)."""
    _ensure_loaded()
    return _ops.refine_with_query_mass_dropout_backward.default(
        _wide(grad_out), _wide(queries), _wide(keys), _wide(values), valid.contiguous(),
        assignments.contiguous(), _wide(centroids), _wide(centroid_values), topk_indices.contiguous(),
        _wide(topk_mass), _wide(topk_values), float(scaling), float(dropout), int(seed),
    )  # fmt: skip


def banded_attention_dropout_backward(
    grad_out: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    window: int,
    scaling: float,
    dropout: float,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """See ``reference.banded_attention_dropout_backward``: float32 gradients of queries, keys and values."""
    _ensure_loaded()
    return _ops.banded_attention_dropout_backward.default(
        _wide(grad_out), _wide(queries), _wide(keys), _wide(values), valid.contiguous(), int(window),
        float(scaling), float(dropout), int(seed),
    )  # fmt: skip


def _register_dropout_backwards() -> None:
    # centroid_rest(centroids, keys, values, valid, topk_indices, scaling, dropout, seed) -> rest
    _register_gradient(
        "centroid_rest",
        lambda g, c, k, v, valid, indices, scaling, dropout, seed: [
            *centroid_rest_backward(g[0], c, k, v, valid, indices, scaling, dropout, seed),
            None, None, None, None, None,
        ],
    )  # fmt: skip

    def topk_refine_gradient(grads, q, k, v, assignments, vc, indices, mass, topv, scaling, dropout, seed):
        found = topk_refine_dropout_backward(
            grads[0], q, k, v, assignments, indices, mass, scaling, dropout, seed
        )
        dq, dk, dv, dvc, dmass, dtopv = found
        return [dq, dk, dv, None, dvc, None, dmass, dtopv, None, None, None]

    _register_gradient("topk_refine_dropout", topk_refine_gradient)

    def plus_gradient(grads, q, k, v, valid, assignments, c, vc, indices, mass, topv, scaling, dropout, seed):
        found = refine_with_query_mass_dropout_backward(
            grads[0], q, k, v, valid, assignments, c, vc, indices, mass, topv, scaling, dropout, seed
        )
        dq, dk, dv, dc, dvc, dmass, dtopv = found
        return [dq, dk, dv, None, None, dc, dvc, None, dmass, dtopv, None, None, None]

    _register_gradient("refine_with_query_mass_dropout", plus_gradient)
    _register_gradient(
        "banded_attention_dropout",
        lambda g, q, k, v, valid, window, scaling, dropout, seed: [
            *banded_attention_dropout_backward(g[0], q, k, v, valid, window, scaling, dropout, seed),
            None, None, None, None, None,
        ],
    )  # fmt: skip


_register_dropout_backwards()
