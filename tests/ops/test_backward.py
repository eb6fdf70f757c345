"""The ops' backward (issue 38): every differentiable op x kernel backend against autograd through the
reference, op by op, plus gradcheck in float64 on the reference steps, opcheck with gradients, determinism,
and end to end through ``clustered_attention``.

Each op's backward is the gradient of what its forward computed given the discrete choices it made
(assignments, top-k indices): the cases feed the kernel op and the reference function the same inputs,
discrete ones included, so ties in the forward's choices (exact ties are common with the ``halves`` inputs)
cannot make the two sides differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from helpers import kernel_backends, require_kernels

from bert_cluster import dispatch
from bert_cluster import reference as ref
from bert_cluster.attention import clustered_attention, hash_planes
from bert_cluster.config import ClusteredAttentionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: Max abs difference of an input gradient, kernel backward vs autograd through the reference, relative to
#: the largest gradient entry of that input (both sum fp32 products, in other orders). Measured max over the
#: grid (AMD EPYC Zen 4, 2026-12-04): fp32 3.6e-7 relative; bf16 the same before the final rounding to
#: bf16 (one ulp: 2^-8 relative) -> fp32 4e-6, bf16 one bf16 ulp (8e-3). The step backward ops
#: (centroid_attention, group_queries, broadcast_clusters; STEP_CASES, 2026-12-04): fp32 6.1e-7 (the
#: centroids' gradient of centroid_attention), fp16 1.9e-6, bf16 1.1e-4; group_queries and
#: broadcast_clusters exact (the same sums in the same order).
GRAD_RTOL = {"fp32": 4e-6, "bf16": 8e-3}


@dataclass(frozen=True)
class Case:
    n: int
    clusters: int
    topk: int
    dk: int
    dv: int
    dtype: str
    padded: bool
    ties: bool = False
    #: Row 0 all padding (every key gradient 0 there; the other rows as ``padded`` says).
    empty_row: bool = False

    def __str__(self) -> str:
        tail = ("-pad" if self.padded else "") + ("-ties" if self.ties else "")
        tail += "-empty-row" if self.empty_row else ""
        return f"N{self.n}-C{self.clusters}-k{self.topk}-D{self.dk}x{self.dv}-{self.dtype}{tail}"


GRID = [
    Case(1, 1, 1, 8, 8, "fp32", False),  # N = 1
    Case(7, 25, 4, 5, 7, "fp32", True),  # C > valid N, odd head dims, Dv != Dk
    Case(31, 4, 8, 16, 16, "bf16", True),
    Case(31, 4, 40, 16, 24, "fp32", True),  # k > N: every valid key in every top-k
    Case(200, 10, 16, 32, 32, "fp32", True),
    Case(200, 10, 16, 32, 32, "bf16", False),
    Case(200, 25, 32, 64, 16, "fp32", True, ties=True),  # many exactly equal scores
    Case(513, 25, 32, 64, 64, "fp32", True),
    Case(300, 6, 91, 32, 32, "fp32", True),  # k > 32: the refinements' slots in three passes of 32
]


def _inputs(case: Case, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows, heads = 2, 2

    def draw(d: int) -> torch.Tensor:
        if case.ties:  # multiples of 1/2 in [-1, 1]: many scores exactly equal
            return torch.randint(-2, 3, (rows, heads, case.n, d), generator=generator).float() / 2
        return torch.randn(rows, heads, case.n, d, generator=generator)

    q, k, v = draw(case.dk), draw(case.dk), draw(case.dv)
    valid = torch.ones(rows, case.n, dtype=torch.bool)
    if case.padded and case.n > 2:
        valid[1, case.n - case.n // 3 :] = False
        valid[1, 0] = False
    if case.empty_row:
        valid[0] = False
    dtype = {**DTYPES, "fp16": torch.float16}[case.dtype]
    return q.to(dtype), k.to(dtype), v.to(dtype), valid


def _pipeline(case: Case, q, k, v, valid):
    """The reference's own discrete choices and intermediate tensors, one set per refinement."""
    scaling = 1 / math.sqrt(case.dk)
    planes, offsets = hash_planes(0, 0, 32, case.dk)
    assignments, _ = ref.hamming_kmeans(ref.hash_queries(q, planes, offsets), valid, case.clusters, 10, 32)
    plus_assignments, centroids, _ = ref.lloyd_refine(q, assignments, case.clusters, 2)
    return scaling, assignments, plus_assignments, centroids


def _grads(function, inputs: dict, output_grad: torch.Tensor | tuple) -> dict:
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    outputs = function(**leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = output_grad if isinstance(output_grad, tuple) else (output_grad,)
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
    found = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [g for _, g in pairs])
    return dict(zip(leaves, found, strict=True))


def _assert_grads_close(got: dict, expected: dict, dtype: str, what: str) -> None:
    for name in expected:
        a, b = got[name].cpu(), expected[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what} d{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert torch.isfinite(a).all(), f"{what} d{name}: not finite"
        scale = max(b.float().abs().max().item(), 1e-6)
        error = (a.float() - b.float()).abs().max().item() / scale
        assert error <= GRAD_RTOL[dtype], f"{what} d{name}: relative error {error:.3g} > {GRAD_RTOL[dtype]}"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("case", GRID, ids=str)
def test_backward_matches_reference_autograd(case: Case, backend: str, device: str) -> None:
    require_kernels(backend)
    kernels = dispatch.BACKENDS[backend]
    q, k, v, valid = _inputs(case)
    scaling, assignments, plus_assignments, centroids = _pipeline(case, q, k, v, valid)
    generator = torch.Generator().manual_seed(1)

    def grad_like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=generator)

    dev = {name: t.to(device) for name, t in {"q": q, "k": k, "v": v, "valid": valid}.items()}
    group_centroids, _ = ref.group_queries(q, assignments, case.clusters)
    for label, cents, parts in (
        ("i-clustered", group_centroids, assignments),
        ("i-clustered+", centroids, plus_assignments),
    ):
        vc, indices, mass, topv = ref.centroid_attention(cents, k, v, valid, case.topk, scaling)
        g_vc, g_mass, g_topv = grad_like(vc), grad_like(mass), grad_like(topv)
        # centroid_attention: with respect to centroids, keys and values.
        inputs = {"centroids": cents, "keys": k, "values": v}

        def centroid_step(backend_step, centroids, keys, values, on):
            vc_, _, mass_, topv_ = backend_step(centroids, keys, values, on, case.topk, scaling)
            return vc_, mass_, topv_

        expected = _grads(
            lambda **t: centroid_step(ref.centroid_attention, **t, on=valid), inputs, (g_vc, g_mass, g_topv)
        )
        got = _grads(
            lambda **t: centroid_step(kernels.centroid_attention, **t, on=dev["valid"]),
            {n: t.to(device) for n, t in inputs.items()},
            tuple(g.to(device) for g in (g_vc, g_mass, g_topv)),
        )
        if torch.equal(
            kernels.centroid_attention(
                cents.to(device), dev["k"], dev["v"], dev["valid"], case.topk, scaling
            )[1].cpu(),
            indices,
        ):
            _assert_grads_close(got, expected, case.dtype, f"{label} centroid_attention")
        out_grad = torch.randn(*q.shape[:-1], case.dv, generator=generator)
        if label == "i-clustered":
            inputs = {
                "queries": q,
                "keys": k,
                "values": v,
                "centroid_values": vc,
                "topk_mass": mass,
                "topk_values": topv,
            }

            def refine(
                step,
                queries,
                keys,
                values,
                centroid_values,
                topk_mass,
                topk_values,
                parts=parts,
                indices=indices,
            ):
                return step(
                    queries,
                    keys,
                    values,
                    parts.to(queries.device),
                    centroid_values,
                    indices.to(queries.device),
                    topk_mass,
                    topk_values,
                    scaling,
                )

            expected = _grads(lambda **t: refine(ref.topk_refine, **t), inputs, out_grad)
            got = _grads(
                lambda **t: refine(kernels.topk_refine, **t),
                {n: t.to(device) for n, t in inputs.items()},
                out_grad.to(device),
            )
            _assert_grads_close(got, expected, case.dtype, "topk_refine")
        else:
            inputs = {
                "queries": q,
                "keys": k,
                "values": v,
                "centroids": cents,
                "centroid_values": vc,
                "topk_mass": mass,
                "topk_values": topv,
            }

            def refine_plus(
                step,
                queries,
                keys,
                values,
                centroids,
                centroid_values,
                topk_mass,
                topk_values,
                parts=parts,
                indices=indices,
            ):
                on = valid.to(queries.device)
                return step(
                    queries,
                    keys,
                    values,
                    on,
                    parts.to(queries.device),
                    centroids,
                    centroid_values,
                    indices.to(queries.device),
                    topk_mass,
                    topk_values,
                    scaling,
                )

            expected = _grads(lambda **t: refine_plus(ref.refine_with_query_mass, **t), inputs, out_grad)
            got = _grads(
                lambda **t: refine_plus(kernels.refine_with_query_mass, **t),
                {n: t.to(device) for n, t in inputs.items()},
                out_grad.to(device),
            )
            _assert_grads_close(got, expected, case.dtype, "refine_with_query_mass")
        # The steps before: the centroids' gradient reaches the queries through the means.
        g_c = grad_like(cents)
        expected = _grads(
            lambda queries, parts=parts: ref.group_queries(queries, parts, case.clusters)[0],
            {"queries": q},
            g_c,
        )
        if label == "i-clustered":
            got = _grads(
                lambda queries, parts=parts: kernels.group_queries(queries, parts.to(device), case.clusters)[
                    0
                ],
                {"queries": dev["q"]},
                g_c.to(device),
            )
        else:
            got = _grads(
                lambda queries: kernels.lloyd_refine(queries, assignments.to(device), case.clusters, 2)[1],
                {"queries": dev["q"]},
                g_c.to(device),
            )
        _assert_grads_close(got, expected, case.dtype, f"{label} centroids")


#: The backward ops of the steps before the refinement, and the inputs each takes after the gradients.
STEP_BACKWARDS = (
    "centroid_attention_backward",
    "group_queries_backward",
    "broadcast_clusters_backward",
    "banded_attention_backward",
)


def _step_backward_args(case: Case, seed: int = 0) -> dict:
    """Each step backward op's arguments (output gradients first), from the reference's own choices."""
    q, k, v, valid = _inputs(case, seed)
    scaling, assignments, _, _ = _pipeline(case, q, k, v, valid)
    centroids, _ = ref.group_queries(q, assignments, case.clusters)
    vc, indices, mass, topv = ref.centroid_attention(centroids, k, v, valid, case.topk, scaling)
    generator = torch.Generator().manual_seed(seed + 7)

    def grad_like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=generator)

    return {
        "centroid_attention_backward": (
            grad_like(vc), grad_like(mass), grad_like(topv), centroids, k, v, valid, indices, scaling,
        ),
        "group_queries_backward": (grad_like(centroids), q, assignments),
        "broadcast_clusters_backward": (grad_like(v.float()), vc, assignments),
        # a band of clusters + 1 keys each side (window >= N at N = 1 and 7)
        "banded_attention_backward": (grad_like(v.float()), q, k, v, valid, case.clusters + 1, scaling),
    }  # fmt: skip


STEP_CASES = [
    *GRID,
    Case(64, 5, 0, 16, 8, "fp32", True, empty_row=True),  # k = 0: plain clustered attention
    Case(64, 5, 8, 16, 16, "fp16", True, empty_row=True),
    Case(64, 40, 8, 16, 16, "fp32", False),  # C > 32: two groups of cluster lanes
]


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("op", STEP_BACKWARDS)
@pytest.mark.parametrize("case", STEP_CASES, ids=str)
def test_step_backward_ops_match_the_reference(case: Case, op: str, backend: str, device: str) -> None:
    """The backward op itself (the kernel where one is built) against the reference's autograd."""
    require_kernels(backend)
    from bert_cluster import ops

    args = _step_backward_args(case)[op]
    expected = getattr(ref, op)(*args)
    on = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = getattr(ops, op)(*on)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    dtype = "fp32" if case.dtype == "fp32" else "bf16"  # fp16: finer than bf16, within its tolerance
    _assert_grads_close(
        {str(i): g for i, g in enumerate(got)}, {str(i): e for i, e in enumerate(expected)}, dtype, op
    )


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("case", STEP_CASES, ids=str)
def test_centroid_backward_into_adds_the_centroid_backward(case: Case, backend: str, device: str) -> None:
    """centroid_attention_backward_into adds the key and value gradients into the given float32 tensors
    (in fp32 bit for bit what adding centroid_attention_backward's gives) and returns the centroids'."""
    require_kernels(backend)
    from bert_cluster import ops

    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in _step_backward_args(case)[
        "centroid_attention_backward"
    ]]  # fmt: skip
    generator = torch.Generator().manual_seed(11)
    base_k, base_v = (torch.randn(t.shape, generator=generator).to(device) for t in args[4:6])
    grad_keys, grad_values = base_k.clone(), base_v.clone()
    d_centroids = ops.centroid_attention_backward_into(grad_keys, grad_values, *args)
    expected_c, expected_k, expected_v = ops.centroid_attention_backward(*args)
    if case.dtype == "fp32":
        assert torch.equal(d_centroids, expected_c)
        assert torch.equal(grad_keys, base_k + expected_k) and torch.equal(grad_values, base_v + expected_v)
    else:  # added before rounding to the inputs' dtype: within that rounding of the separate op's
        reference = ref.centroid_attention_backward(
            *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        )
        _assert_grads_close(
            {"c": d_centroids, "k": grad_keys - base_k, "v": grad_values - base_v},
            {"c": reference[0], "k": reference[1].float(), "v": reference[2].float()},
            "bf16",
            "centroid_attention_backward_into",
        )


@pytest.mark.parametrize("op", STEP_BACKWARDS)
def test_step_backward_ops_give_the_same_bits_at_any_thread_count(op: str) -> None:
    from bert_cluster import ops

    require_kernels("cpu")
    args = _step_backward_args(Case(700, 25, 32, 64, 64, "bf16", True), seed=2)[op]
    before = torch.get_num_threads()
    try:
        found = []
        for threads in (1, 2, 3, 3):
            torch.set_num_threads(threads)
            out = getattr(ops, op)(*args)
            found.append(out if isinstance(out, tuple) else (out,))
    finally:
        torch.set_num_threads(before)
    for other in found[1:]:
        for a, b in zip(found[0], other, strict=True):
            assert torch.equal(a, b), f"{op}: the gradient bits depend on the thread count or the run"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["i-clustered+", "i-clustered", "clustered"])
def test_clustered_attention_gradients_match_the_reference_backend(
    backend: str, device: str, dtype: str, mode: str
) -> None:
    """End to end, a mixed batch: one row short enough for exact attention, one padded, one full."""
    require_kernels(backend)
    case = Case(200, 25, 32, 64, 64, dtype, True)
    q, k, v, valid = _inputs(case, seed=3)
    q, k, v = (torch.cat([t, t[:1]]) for t in (q, k, v))
    valid = torch.cat([valid, valid[:1]])
    valid[2, 20:] = False  # 20 valid tokens <= C: exact attention
    out_grad = torch.randn(*q.shape[:-1], 64, generator=torch.Generator().manual_seed(4))
    base = ClusteredAttentionConfig(clusters=25, topk=32, mode=mode, min_length=0)
    expected = _grads(
        lambda **t: clustered_attention(**t, valid=valid, config=base.replace(backend="reference")),
        {"query": q, "key": k, "value": v},
        out_grad.to(q.dtype),
    )
    on = valid.to(device)
    got = _grads(
        lambda **t: clustered_attention(**t, valid=on, config=base.replace(backend=backend)),
        {"query": q.to(device), "key": k.to(device), "value": v.to(device)},
        out_grad.to(q.dtype).to(device),
    )
    _assert_grads_close(got, expected, dtype, f"clustered_attention {mode}")


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("mode", ["i-clustered+", "i-clustered", "clustered"])
def test_one_node_backward_equals_autograd_through_the_steps(backend: str, device: str, mode: str) -> None:
    """A recording call on a kernel backend is one autograd node (``_StepsWithBackward``) whose backward
    chains the steps' backward ops by hand: in float32 it gives autograd's bits through the composed ops,
    each with its registered backward (every sum has two terms, and a + b = b + a)."""
    require_kernels(backend)
    from bert_cluster import attention

    case = Case(300, 10, 16, 32, 24, "fp32", True)
    q, k, v, valid = (t.to(device) for t in _inputs(case, seed=7))
    config = ClusteredAttentionConfig(clusters=10, topk=16, mode=mode, min_length=0)
    planes, offsets, *settings = attention.step_arguments(config, 10, 16, case.dk**-0.5, 0, q)
    chosen = dispatch.BACKENDS[backend]()
    out_grad = torch.randn(*q.shape[:-1], case.dv, generator=torch.Generator().manual_seed(8)).to(device)
    one_node = _grads(
        lambda **t: attention._StepsWithBackward.apply(
            *t.values(), valid, chosen, planes, offsets, *settings
        ),
        {"query": q, "key": k, "value": v},
        out_grad,
    )
    composed = _grads(
        lambda **t: attention._composed(chosen, *t.values(), valid, planes, offsets, *settings),
        {"query": q, "key": k, "value": v},
        out_grad,
    )
    for name in composed:
        assert torch.equal(one_node[name], composed[name]), f"d{name}: one node != the composed steps"
    leaf = q.clone().requires_grad_()
    out = clustered_attention(leaf, k, v, valid, config.replace(backend=backend))
    assert type(out.grad_fn).__name__ == "_StepsWithBackwardBackward", out.grad_fn


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["i-clustered+", "i-clustered", "clustered"])
def test_backward_reads_transformers_layout_as_contiguous(mode: str, dtype: str) -> None:
    """Queries, keys, values and the output gradient in (B, L, H, D) memory, as transformers gives them:
    the CPU backward kernels read them through their strides (no contiguous copy), with the same bits."""
    require_kernels("cpu")
    q, k, v, valid = _inputs(Case(300, 10, 16, 32, 32, dtype, True), seed=9)
    out_grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(q.dtype)
    config = ClusteredAttentionConfig(clusters=10, topk=16, mode=mode, min_length=0, backend="cpu")

    def transformers_layout(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    laid_out = {name: transformers_layout(t) for name, t in {"query": q, "key": k, "value": v}.items()}
    assert not laid_out["query"].is_contiguous()

    def attend(**t):
        return clustered_attention(**t, valid=valid, config=config)

    strided = _grads(attend, laid_out, transformers_layout(out_grad))
    contiguous = _grads(attend, {"query": q, "key": k, "value": v}, out_grad)
    for name in contiguous:
        assert torch.equal(strided[name], contiguous[name]), f"d{name}: the layout changed the gradient"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("mode", ["i-clustered+", "i-clustered", "clustered"])
def test_two_backward_passes_give_the_same_bits(backend: str, device: str, mode: str) -> None:
    require_kernels(backend)
    q, k, v, valid = (t.to(device) for t in _inputs(Case(700, 25, 32, 64, 64, "fp32", True), seed=5))
    config = ClusteredAttentionConfig(clusters=25, topk=32, mode=mode, min_length=0, backend=backend)
    out_grad = torch.randn(*q.shape, generator=torch.Generator().manual_seed(6)).to(device)
    first, second = (
        _grads(
            lambda **t: clustered_attention(**t, valid=valid, config=config),
            {"query": q, "key": k, "value": v},
            out_grad,
        )
        for _ in range(2)
    )
    for name in first:
        assert torch.equal(first[name], second[name]), (
            f"d{name} differs between two identical backward passes"
        )


@pytest.mark.slow(reason="gradcheck in float64 of every reference step: one forward per input element")
def test_reference_steps_pass_gradcheck_in_float64() -> None:
    torch.manual_seed(0)
    rows, heads, n, dim, clusters, topk, scaling = 2, 2, 12, 4, 3, 4, 0.5
    q, k, v = (torch.randn(rows, heads, n, dim, dtype=torch.float64) for _ in range(3))
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, 9:] = False
    planes, offsets = hash_planes(0, 0, 8, dim)
    assignments, _ = ref.hamming_kmeans(ref.hash_queries(q, planes, offsets), valid, clusters, 10, 8)
    centroids, _ = ref.group_queries(q, assignments, clusters)
    vc, indices, mass, topv = ref.centroid_attention(centroids, k, v, valid, topk, scaling)
    assert vc.dtype == torch.float64  # the reference computes in float64 for float64 inputs
    checks = {
        "group_queries": (lambda q_: ref.group_queries(q_, assignments, clusters)[0], (q,)),
        "centroid_attention": (
            lambda c_, k_, v_: ref.centroid_attention_with_topk(c_, k_, v_, valid, indices, scaling),
            (centroids, k, v),
        ),
        "topk_refine": (
            lambda q_, k_, v_, vc_, m_, tv_: ref.topk_refine(
                q_, k_, v_, assignments, vc_, indices, m_, tv_, scaling
            ),
            (q, k, v, vc, mass, topv),
        ),
        "refine_with_query_mass": (
            lambda q_, k_, v_, c_, vc_, m_, tv_: ref.refine_with_query_mass(
                q_, k_, v_, valid, assignments, c_, vc_, indices, m_, tv_, scaling
            ),
            (q, k, v, centroids, vc, mass, topv),
        ),
        "broadcast_clusters": (lambda vc_: ref.broadcast_clusters(vc_, assignments), (vc,)),
        "banded_attention": (
            lambda q_, k_, v_: ref.banded_attention(q_, k_, v_, valid, 2, scaling),
            (q, k, v),
        ),
    }
    for name, (function, inputs) in checks.items():
        leaves = tuple(t.detach().clone().requires_grad_() for t in inputs)
        assert torch.autograd.gradcheck(function, leaves), name


def _op_cases():
    torch.manual_seed(0)
    rows, heads, n, dim, clusters, topk, scaling = 2, 2, 40, 16, 5, 8, 0.25
    q, k, v = (torch.randn(rows, heads, n, dim) for _ in range(3))
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, 30:] = False
    planes, offsets = hash_planes(0, 0, 16, dim)
    assignments, _ = ref.hamming_kmeans(ref.hash_queries(q, planes, offsets), valid, clusters, 10, 16)
    plus, centroids, _ = ref.lloyd_refine(q, assignments, clusters, 2)
    vc, indices, mass, topv = ref.centroid_attention(centroids, k, v, valid, topk, scaling)

    def grad(t: torch.Tensor) -> torch.Tensor:
        return t.clone().requires_grad_()

    return {
        "group_queries": (grad(q), assignments, clusters),
        "lloyd_refine": (grad(q), assignments, clusters, 2),
        "centroid_attention": (grad(centroids), grad(k), grad(v), valid, topk, scaling),
        "topk_refine": (grad(q), grad(k), grad(v), plus, grad(vc), indices, grad(mass), grad(topv), scaling),
        "refine_with_query_mass": (
            grad(q),
            grad(k),
            grad(v),
            valid,
            plus,
            grad(centroids),
            grad(vc),
            indices,
            grad(mass),
            grad(topv),
            scaling,
        ),
        "broadcast_clusters": (grad(vc), plus),
        "banded_attention": (grad(q), grad(k), grad(v), valid, 3, scaling),
        # The backward ops (no gradient of their own): schema and fake kernel.
        "centroid_attention_backward": (
            torch.randn(vc.shape), torch.randn(mass.shape), torch.randn(topv.shape), centroids, k, v, valid,
            indices, scaling,
        ),
        "centroid_attention_backward_into": (
            torch.randn(k.shape), torch.randn(v.shape), torch.randn(vc.shape), torch.randn(mass.shape),
            torch.randn(topv.shape), centroids, k, v, valid, indices, scaling,
        ),
        "group_queries_backward": (torch.randn(centroids.shape), q, plus),
        "broadcast_clusters_backward": (torch.randn(rows, heads, n, dim), vc, plus),
        "banded_attention_backward": (torch.randn(rows, heads, n, dim), q, k, v, valid, 3, scaling),
    }  # fmt: skip


@pytest.mark.parametrize("op", list(_op_cases()))
def test_opcheck_with_gradients(op: str) -> None:
    dispatch.CpuKernelBackend.is_available()  # loads _C (its CPU kernels) where it is built
    args = _op_cases()[op]
    # opcheck's AOT test sums every output into one tensor that starts as the first output's sum, in place:
    # lloyd_refine's first output (assignments) is int64, so adding the float centroids fails inside the
    # harness. Its autograd registration and fake kernel are still checked.
    tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if op == "lloyd_refine":
        tests.remove("test_aot_dispatch_dynamic")
    if "_backward" in op:
        tests = ["test_schema", "test_faketensor"]
    torch.library.opcheck(getattr(torch.ops.bert_cluster, op).default, args, test_utils=tests)
