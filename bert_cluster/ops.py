"""The ``bert_cluster`` ops, each declared once: the only C++ bridge.

An op is declared by the reference function that defines it (``Op(reference.hash_queries)``): its schema
is that function's signature, so the op has the oracle's name, arguments, defaults and outputs, and the
``Op`` is its typed wrapper. Beside each declaration stand its fake (meta) kernel and, where it is
differentiable, its autograd formula. The schemas exist (and ``torch.compile`` traces them through the
fakes) whether or not ``bert_cluster._C`` was built; ``kernels/cpu/*.cpp`` and ``kernels/cuda/*.cu`` only
register implementations for these names. ``bert_cluster.steps`` says which kernels compile each op.

This module is imported lazily (by the kernel backends in ``bert_cluster.dispatch``), never by
``import bert_cluster``. Import order, with no circle: ``environment`` <- ``_loader`` (imports ``_C``)
<- ``ops`` (schemas, then ``_C``) <- ``dispatch`` (availability) <- ``_build`` (build facts, the driver).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

import torch

from bert_cluster import _loader, reference, steps

NAMESPACE = "bert_cluster"

_LIB = torch.library.Library(NAMESPACE, "DEF")
_ops = getattr(torch.ops, NAMESPACE)
_loaded = [False]  # whether _loader.load() ran: the CPU/CUDA implementations register when _C loads

P = ParamSpec("P")
R = TypeVar("R")


class Op(Generic[P, R]):
    """The op ``bert_cluster::<name>``, declared by the function that defines it.

    Its schema is the function's signature, inferred by ``torch.library.infer_schema`` (ints are int64:
    the kernels take ``int64_t`` and the fakes size their outputs with them, where a ``SymInt`` would make
    ``torch.compile`` pass symbols). Calling it loads ``_C`` on first use and runs the dispatcher's kernel.

    Args:
        declaration: the step's reference function (``bert_cluster.steps`` names it; tests/test_steps.py
            checks that the op has its signature), or a signature of its own where that function stands
            above this module (the fused ops, composed in ``attention``).
        name: the op's name when it is not the function's.
        mutates: the arguments the op writes into.
    """

    def __init__(
        self, declaration: Callable[P, R], *, name: str | None = None, mutates: tuple[str, ...] = ()
    ) -> None:
        self.__name__ = name or declaration.__name__
        schema = torch.library.infer_schema(declaration, mutates_args=mutates).replace("SymInt", "int")
        _LIB.define(self.__name__ + schema)
        self.overload = getattr(_ops, self.__name__).default
        self.__signature__ = inspect.signature(declaration)
        self.__doc__ = (
            f"``torch.ops.{NAMESPACE}.{self.__name__}``: see ``{steps.BY_NAME[self.__name__].reference}``."
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the op (the kernel of the inputs' device)."""
        if not _loaded[0]:
            load_kernels()
        return self.overload(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        """Register ``fake`` (shapes and dtypes only) as the op's meta kernel; returns it."""
        torch.library.register_fake(f"{NAMESPACE}::{self.__name__}", fake)
        return fake


def load_kernels() -> dict:
    """Import ``bert_cluster._C`` (once, after the schemas exist); the loader's state."""
    state = _loader.load(first_use=_build_cpu_kernels)
    _loaded[0] = True
    return state


def _ensure_loaded() -> None:
    if not _loaded[0]:
        load_kernels()


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


def _float32(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t, dtype=torch.float32) for t in tensors)


# ---------------------------------------------------------------------------------------------------
# The steps (the paper's, then i-clustered+'s), each with its fake kernel.

hash_queries = Op(reference.hash_queries)


@hash_queries.register_fake
def _(queries, planes, offsets):
    return queries.new_empty(queries.shape[:-1], dtype=torch.int64)


hamming_kmeans = Op(reference.hamming_kmeans)


@hamming_kmeans.register_fake
def _(hashes, valid, clusters, iterations, bits):
    rows, heads, _ = hashes.shape
    return hashes.new_empty(hashes.shape, dtype=torch.int64), hashes.new_empty(
        (rows, heads, clusters), dtype=torch.int64
    )


group_queries = Op(reference.group_queries)


@group_queries.register_fake
def _(queries, assignments, clusters):
    rows, heads, _, dk = queries.shape
    return (
        queries.new_empty((rows, heads, clusters, dk), dtype=torch.float32),
        queries.new_empty((rows, heads, clusters), dtype=torch.float32),
    )


centroid_attention = Op(reference.centroid_attention)


@centroid_attention.register_fake
def _(centroids, keys, values, valid, topk, scaling):
    rows, heads, clusters, _ = centroids.shape
    dv = values.shape[-1]
    k = torch.sym_min(topk, keys.shape[-2])
    return (
        centroids.new_empty((rows, heads, clusters, dv), dtype=torch.float32),
        centroids.new_empty((rows, heads, clusters, k), dtype=torch.int64),
        centroids.new_empty((rows, heads, clusters), dtype=torch.float32),
        centroids.new_empty((rows, heads, clusters, dv), dtype=torch.float32),
    )


def _query_rows(queries, values, *rest):
    """The refinements' and the band's output: float32 ``(R, H, N, Dv)``."""
    return queries.new_empty((*queries.shape[:-1], values.shape[-1]), dtype=torch.float32)


topk_refine = Op(reference.topk_refine)
topk_refine.register_fake(lambda queries, keys, values, *rest: _query_rows(queries, values))

broadcast_clusters = Op(reference.broadcast_clusters)


@broadcast_clusters.register_fake
def _(centroid_values, assignments):
    return centroid_values.new_empty((*assignments.shape, centroid_values.shape[-1]))


banded_attention = Op(reference.banded_attention)
banded_attention.register_fake(lambda queries, keys, values, *rest: _query_rows(queries, values))

# i-clustered+ (issue 13; w4-fidelity): Lloyd rounds on the real query vectors, and refinement with each
# query's own top-k mass (kernels/cpu/lloyd.cpp, query_mass.cpp; kernels/cuda/plus.cu).
lloyd_refine = Op(reference.lloyd_refine)


@lloyd_refine.register_fake
def _(queries, assignments, clusters, iterations):
    rows, heads, n, dk = queries.shape
    return (
        queries.new_empty((rows, heads, n), dtype=torch.int64),
        queries.new_empty((rows, heads, clusters, dk), dtype=torch.float32),
        queries.new_empty((rows, heads, clusters), dtype=torch.float32),
    )


refine_with_query_mass = Op(reference.refine_with_query_mass)
refine_with_query_mass.register_fake(lambda queries, keys, values, *rest: _query_rows(queries, values))

# Attention dropout's own step (kernels/cpu/dropout.cpp): the centroids' attention over the keys outside
# their top-k, dropped per (centroid, key).
centroid_rest = Op(reference.centroid_rest)


@centroid_rest.register_fake
def _(centroids, keys, values, *rest):
    return centroids.new_empty((*centroids.shape[:-1], values.shape[-1]), dtype=torch.float32)


# Every step of one attention call as one op (kernels/cpu/pipeline.cpp): the steps above, run per (row, head)
# in one parallel region, with their results bit for bit. Its reference, attention.composed_heads, composes
# the same steps one by one (on the backends that lack the op too) and has this signature (test_steps.py).
def _one_call(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
    planes: torch.Tensor, offsets: torch.Tensor, clusters: int, topk: int, iterations: int, mode: str,
    lloyd_rounds: int, scaling: float,
) -> torch.Tensor:  # fmt: skip
    """Hashing to refinement: float32 ``(R, H, N, Dv)``, a view of ``(R, N, H, Dv)`` memory.

    The layout transformers takes attention's output in, so handing it over costs no copy.
    """


clustered_heads = Op(_one_call, name="clustered_heads")


@clustered_heads.register_fake
def _(queries, keys, values, *settings):
    rows, heads, length = queries.shape[:-1]
    return queries.new_empty((rows, length, heads, values.shape[-1]), dtype=torch.float32).transpose(1, 2)


# The same and the partition it used (what a recording pass keeps for the backward); its reference is
# attention.composed_heads_partition.
def _one_call_partition(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
    planes: torch.Tensor, offsets: torch.Tensor, clusters: int, topk: int, iterations: int, mode: str,
    lloyd_rounds: int, scaling: float,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:  # fmt: skip
    """``(out, assignments, centroids, centroid_values, topk_indices, topk_mass, topk_values)``.

    ``out`` as ``clustered_heads`` gives it, the rest as the separate steps do (``attention.Partition``).
    """


clustered_heads_partition = Op(_one_call_partition, name="clustered_heads_partition")


@clustered_heads_partition.register_fake
def _(queries, keys, values, valid, planes, offsets, clusters, topk, iterations, mode, lloyd_rounds, scaling):
    rows, heads, length, dk = queries.shape
    dv, k = values.shape[-1], min(topk, length) if steps.MODES[mode].uses_topk else 0
    small = (rows, heads, clusters)
    return (
        queries.new_empty((rows, length, heads, dv), dtype=torch.float32).transpose(1, 2),
        queries.new_empty((rows, heads, length), dtype=torch.long),
        queries.new_empty((*small, dk), dtype=torch.float32),
        queries.new_empty((*small, dv), dtype=torch.float32),
        queries.new_empty((*small, k), dtype=torch.long),
        queries.new_empty(small, dtype=torch.float32),
        queries.new_empty((*small, dv), dtype=torch.float32),
    )


# ---------------------------------------------------------------------------------------------------
# The backward ops (issue 38): the kernels (kernels/cpu/backward.cpp, backward_steps.cpp, dropout.cpp;
# kernels/cuda/backward.cu and plus.cu) where they are built, and elsewhere (a build without kernels,
# another device) the gradient of the reference function, registered below as a composite. Gradients come
# in float32 and contiguous (the autograd formulas below cast), except where a kernel reads its inputs'
# rows in their dtype and layout (topk_refine_backward's queries, keys and values, as the forward).

topk_refine_backward = Op(reference.topk_refine_backward)


@topk_refine_backward.register_fake
def _(grad_out, queries, keys, values, assignments, topk_indices, topk_mass, *rest):
    rows, heads, clusters, _ = topk_indices.shape
    centroid_grad = values.new_empty((rows, heads, clusters, values.shape[-1]))
    return (
        *_float32(queries, keys, values),
        centroid_grad,
        topk_mass.new_empty(topk_mass.shape),
        torch.empty_like(centroid_grad),
    )


refine_with_query_mass_backward = Op(reference.refine_with_query_mass_backward)


@refine_with_query_mass_backward.register_fake
def _(grad_out, queries, keys, values, valid, assignments, centroids, centroid_values, indices, mass, *rest):
    topv = rest[0]
    return tuple(torch.empty_like(t) for t in (queries, keys, values, centroids, centroid_values, mass, topv))


centroid_attention_backward = Op(reference.centroid_attention_backward)


@centroid_attention_backward.register_fake
def _(grad_centroid_values, grad_topk_mass, grad_topk_values, centroids, keys, values, *rest):
    return torch.empty_like(centroids), torch.empty_like(keys), torch.empty_like(values)


# The same, adding the key and value gradients into its first two arguments; returns the centroids'.
centroid_attention_backward_into = Op(
    reference.centroid_attention_backward_into, mutates=("grad_keys", "grad_values")
)


@centroid_attention_backward_into.register_fake
def _(grad_keys, grad_values, grad_centroid_values, grad_topk_mass, grad_topk_values, centroids, *rest):
    return torch.empty_like(centroids, dtype=torch.float32)


group_queries_backward = Op(reference.group_queries_backward)
group_queries_backward.register_fake(lambda grad_centroids, queries, assignments: torch.empty_like(queries))

broadcast_clusters_backward = Op(reference.broadcast_clusters_backward)
broadcast_clusters_backward.register_fake(
    lambda grad_out, centroid_values, assignments: torch.empty_like(centroid_values)
)

banded_attention_backward = Op(reference.banded_attention_backward)
banded_attention_backward.register_fake(
    lambda grad_out, queries, keys, values, *rest: _float32(queries, keys, values)
)

centroid_rest_backward = Op(reference.centroid_rest_backward)
centroid_rest_backward.register_fake(
    lambda grad_rest, centroids, keys, values, *rest: _float32(centroids, keys, values)
)

#: The ops every kernel backend compiles (the table's order).
OPS = tuple(step.name for step in steps.STEPS if step.op and step.compiled == steps.KERNEL_BACKENDS)
#: The ops whose compiled implementation is still to come: the kernel backends run the reference for them
#: and the kernel backends do not require them from ``_C``. Empty: kernels/ implements every op.
PENDING_KERNELS: frozenset[str] = frozenset()
#: The ops ``_C`` must register (per device) for a kernel backend to count as available.
KERNEL_OPS = tuple(op for op in OPS if op not in PENDING_KERNELS)
#: The ops ``_C`` implements for the CPU only.
CPU_ONLY_OPS = tuple(step.name for step in steps.STEPS if step.op and step.compiled == steps.CPU)


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
        if step.op and step.name.endswith("_backward"):
            torch.library.impl(
                f"{NAMESPACE}::{step.name}",
                "CompositeExplicitAutograd",
                in_op(step.reference_function()),
                lib=_LIB,
            )


_register_reference_backwards()


# ---------------------------------------------------------------------------------------------------
# Autograd (issue 38): the gradient of each differentiable op is the gradient of its reference function
# given the discrete choices its forward made (assignments, top-k indices), which carry none; steps.py says
# which backward op computes each (``Step.backward``). Hashing and K-means have integer outputs only.


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
    grads, queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values, scaling,
    dropout, seed,
):  # fmt: skip
    found = topk_refine_backward(  # q, k, v read in their dtype and layout (no widened copies)
        _wide_rows(grads[0]), queries, keys, values, assignments.contiguous(),
        topk_indices.contiguous(), _wide(topk_mass), float(scaling), dropout, seed,
    )  # fmt: skip
    dq, dk, dv, dvc, dmass, dtopv = found
    return [dq, dk, dv, None, dvc, None, dmass, dtopv, None, None, None]


def _refine_with_query_mass_gradient(
    grads, queries, keys, values, valid, assignments, centroids, centroid_values, topk_indices, topk_mass,
    topk_values, scaling, dropout, seed,
):  # fmt: skip
    found = refine_with_query_mass_backward(
        _wide_rows(grads[0]), _wide_rows(queries), _wide_rows(keys), _wide_rows(values),
        valid.contiguous(), assignments.contiguous(), _wide(centroids), _wide(centroid_values),
        topk_indices.contiguous(), _wide(topk_mass), _wide(topk_values), float(scaling), dropout, seed,
    )  # fmt: skip
    dq, dk, dv, dc, dvc, dmass, dtopv = found
    return [dq, dk, dv, None, None, dc, dvc, None, dmass, dtopv, None, None, None]


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
    computes = steps.MODES[mode]
    g_centroids = None
    if not computes.uses_topk:
        g_vc = broadcast_clusters_backward(_wide(grad_out), centroid_values, assignments.contiguous())
        g_mass = g_topv = None
        dq = dk = dv = None
    elif computes.query_mass:
        found = _refine_with_query_mass_gradient(
            (grad_out,), queries, keys, values, valid, assignments, centroids, centroid_values,
            topk_indices, topk_mass, topk_values, scaling, 0.0, 0,
        )  # fmt: skip
        dq, dk, dv, _, _, g_centroids, g_vc, _, g_mass, g_topv, *_ = found
    else:
        found = _topk_refine_gradient(
            (grad_out,), queries, keys, values, assignments, centroid_values, topk_indices, topk_mass,
            topk_values, scaling, 0.0, 0,
        )  # fmt: skip
        dq, dk, dv, _, g_vc, _, g_mass, g_topv, *_ = found
    del grad_out
    small = centroids.shape[:3]
    if dk is None:  # plain clustered attention: the centroid attention's are the only key and value gradients
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


def _register_gradient(op: Op, gradient, kept_outputs: tuple[int, ...] = ()) -> None:
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

    torch.library.register_autograd(f"{NAMESPACE}::{op.__name__}", backward, setup_context=setup_context)


# group_queries(queries, assignments, clusters) -> (centroids, counts)
_register_gradient(group_queries, lambda g, q, a, c: [_means_gradient(g[0], q, a), None, None])
# lloyd_refine(queries, assignments, clusters, iterations) -> (assignments, centroids, counts): the centroids
# are the means of the final partition (output 0), as group_queries gives them.
_register_gradient(
    lloyd_refine,
    lambda g, q, a, c, rounds, final: [_means_gradient(g[1], q, final), None, None, None],
    kept_outputs=(0,),
)
# centroid_attention(centroids, keys, values, valid, topk, scaling) -> (Vc, indices, mass, topv), given the
# top-k choice (output 1).
_register_gradient(centroid_attention, _centroid_attention_gradient, kept_outputs=(1,))
# The refinements, with the forward's dropout and seed (their masks are drawn again).
_register_gradient(topk_refine, _topk_refine_gradient)
_register_gradient(refine_with_query_mass, _refine_with_query_mass_gradient)
# broadcast_clusters(Vc, assignments) -> out
_register_gradient(broadcast_clusters, _broadcast_gradient)
# banded_attention(queries, keys, values, valid, window, scaling, dropout, seed) -> out
_register_gradient(
    banded_attention,
    lambda g, q, k, v, valid, window, scaling, dropout, seed: [
        *banded_attention_backward(_wide(g[0]), q, k, v, valid.contiguous(), window, scaling, dropout, seed),
        None, None, None, None, None,
    ],
)  # fmt: skip
# centroid_rest(centroids, keys, values, valid, topk_indices, scaling, dropout, seed) -> rest
_register_gradient(
    centroid_rest,
    lambda g, c, k, v, valid, indices, scaling, dropout, seed: [
        *centroid_rest_backward(_wide(g[0]), c, k, v, valid, indices, scaling, dropout, seed),
        None, None, None, None, None,
    ],
)  # fmt: skip
