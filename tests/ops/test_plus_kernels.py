"""i-clustered+'s compiled steps (``lloyd_refine``, ``refine_with_query_mass`` and its backward) and the
band's backward on every kernel backend: the CPU kernels here, the CUDA ones (kernels/cuda/plus.cu,
backward.cu) where a GPU is lent (``pytest -m cuda``, run by scripts/gpu_check.sh).

lloyd_refine sums each cluster's members in query order on every side, so one partition's means agree bit for
bit; its distances are the CPU kernel's FMA chain over the features on CUDA too, so the two kernels give the
same assignments, and the reference (a GEMM, another order) the same away from near ties. The float steps
are compared with the CPU suite's measured tolerances; the CUDA ones were written without a GPU, and their
first GPU run measures them.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import kernel_backends, require_kernels

from bert_cluster import dispatch
from bert_cluster import reference as ref
from bert_cluster.attention import hash_planes

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: refine_with_query_mass against the reference on the reference's own inputs: REFINE_ATOL of
#: tests/test_clustered_plus.py (CPU measured 4.8e-7 on every dtype).
REFINE_ATOL = 4e-6
#: A Lloyd disagreement must be a near tie: the two clusters' distances differ by at most this, relative to
#: the distance scale (TIE_RTOL of tests/test_clustered_plus.py).
TIE_RTOL = 1e-5
#: Gradients against the reference's autograd, relative to the largest entry (GRAD_RTOL of test_backward.py).
GRAD_RTOL = 4e-6

cuda_only = pytest.mark.parametrize(
    "backend,device", [pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda)]
)


def blobs(rows=2, heads=3, n=257, dk=32, centres=9, spread=0.05, seed=7):
    """Queries around well-separated centres (clear margins: no near tie), and a random start partition."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(rows, heads, centres, dk, generator=g) * 3
    which = torch.randint(0, centres, (rows, heads, n), generator=g)
    queries = centre.gather(2, which[..., None].expand(-1, -1, -1, dk))
    return queries + spread * torch.randn(rows, heads, n, dk, generator=g)


def _on(device: str, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


# ---------------------------------------------------------------------------------------------------
# lloyd_refine


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_lloyd_matches_the_reference_on_separated_inputs(backend, device, dtype, iterations):
    require_kernels(backend)
    queries = blobs().to(DTYPES[dtype])
    start = torch.randint(0, 12, queries.shape[:-1], generator=torch.Generator().manual_seed(2))
    start[1, :, 200:] = -1  # padding stays -1
    start[0, 1, :] = 3  # every query in one cluster: the other 11 start empty and stay so (never win)
    expected = ref.lloyd_refine(queries, start, 12, iterations)
    given = start.to(device)
    step = dispatch.BACKENDS[backend].lloyd_refine
    got = [t.cpu() for t in step(queries.to(device), given, 12, iterations)]
    assert torch.equal(got[0], expected[0]), "assignments differ"
    assert torch.equal(got[2], expected[2]), "counts differ"
    assert got[1].dtype == torch.float32
    assert torch.equal(got[1], expected[1]), "the means of one partition differ (same sums, same order)"
    assert torch.equal(given.cpu(), start)  # the op is functional: its input is not modified


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_lloyd_stops_at_a_fixed_point_as_more_rounds(backend, device):
    """The CUDA kernel decides the early stop on the device (a flag per (row, head)): more rounds than the
    fixed point needs must give the same result bit for bit."""
    require_kernels(backend)
    queries = blobs(n=300, dk=16, centres=6, spread=0.4, seed=3).to(device)
    start = torch.randint(0, 6, queries.shape[:-1], generator=torch.Generator().manual_seed(4)).to(device)
    step = dispatch.BACKENDS[backend].lloyd_refine
    few, many = step(queries, start, 6, 25), step(queries, start, 6, 200)
    for a, b in zip(few, many, strict=True):
        assert torch.equal(a, b)
    expected = ref.lloyd_refine(queries.cpu(), start.cpu(), 6, 25)
    assert torch.equal(few[0].cpu(), expected[0])


def _near_tie(queries, centroids, query, a, b) -> bool:
    c = centroids.double()
    d = (c * c).sum(-1) - 2 * (queries.double() @ c.transpose(-1, -2))
    scale = float(queries.double().pow(2).sum(-1).max()) + float((c * c).sum(-1).max())
    return abs(float(d[query, a] - d[query, b])) <= TIE_RTOL * scale


@cuda_only
@pytest.mark.parametrize("seed", range(3))
def test_cuda_lloyd_gives_the_cpu_kernels_assignments(backend, device, seed):
    """Random inputs (near ties possible): the CUDA kernel against the CPU kernel, one round from a given
    partition; a disagreement must be a near tie of the start partition's means."""
    require_kernels(backend)
    require_kernels("cpu")
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(2, 4, 1024, 64, generator=g)
    start = torch.randint(0, 25, queries.shape[:-1], generator=g)
    start[1, :, 900:] = -1
    _, means, _ = ref.lloyd_refine(queries, start, 25, 0)
    cpu = dispatch.BACKENDS["cpu"].lloyd_refine(queries, start, 25, 1)
    step = dispatch.BACKENDS[backend].lloyd_refine
    got = [t.cpu() for t in step(queries.to(device), start.to(device), 25, 1)]
    for r, h, i in (got[0] != cpu[0]).nonzero().tolist():
        assert _near_tie(queries[r, h], means[r, h], i, int(got[0][r, h, i]), int(cpu[0][r, h, i])), (
            f"query {(r, h, i)}: cuda {int(got[0][r, h, i])}, cpu {int(cpu[0][r, h, i])}, not a tie"
        )
    if torch.equal(got[0], cpu[0]):
        assert torch.equal(got[1], cpu[1]) and torch.equal(got[2], cpu[2])


# ---------------------------------------------------------------------------------------------------
# refine_with_query_mass


def _plus_inputs(n, clusters, topk, dk, dv, dtype="fp32", seed=0, pad="holes", rows=2, heads=2):
    """refine_with_query_mass's inputs as i-clustered+ makes them, from the reference steps."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, heads, n, dk, generator=g).to(DTYPES[dtype]) for _ in range(2))
    v = torch.randn(rows, heads, n, dv, generator=g).to(DTYPES[dtype])
    valid = torch.ones(rows, n, dtype=torch.bool)
    if pad == "holes" and n > 2:
        valid[-1, n - n // 3 :] = False
        valid[-1, 0] = False
    elif pad == "empty-row":
        valid[0] = False
    scaling = 1 / math.sqrt(dk)
    planes, offsets = hash_planes(0, 0, 32, dk)
    assignments, _ = ref.hamming_kmeans(ref.hash_queries(q, planes, offsets), valid, clusters, 10, 32)
    assignments, centroids, _ = ref.lloyd_refine(q, assignments, clusters, 2)
    attended = ref.centroid_attention(centroids, k, v, valid, topk, scaling)
    return (q, k, v, valid, assignments, centroids, *attended, scaling)


PLUS_CASES = {
    "N1": dict(n=1, clusters=1, topk=1, dk=8, dv=8),
    "C>validN-odd-dims": dict(n=7, clusters=25, topk=4, dk=5, dv=7),
    "k>N-exact": dict(n=31, clusters=4, topk=40, dk=16, dv=24),  # C < valid length <= k: m_i = 1
    "k0": dict(n=64, clusters=5, topk=0, dk=16, dv=8),  # no key to refine: the centroid's row
    "empty-row": dict(n=64, clusters=5, topk=8, dk=16, dv=16, pad="empty-row"),
    "bf16": dict(n=200, clusters=10, topk=16, dk=32, dv=32, dtype="bf16"),
    "fp16": dict(n=200, clusters=10, topk=16, dk=32, dv=32, dtype="fp16"),
    "k91": dict(n=300, clusters=6, topk=91, dk=32, dv=32),  # more slots than a shared-memory chunk
    "D256x72": dict(n=150, clusters=8, topk=24, dk=256, dv=72),
    "D512": dict(n=80, clusters=4, topk=40, dk=512, dv=512),  # chunks of 8 keys
}


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("case", list(PLUS_CASES))
def test_refine_with_query_mass_matches_the_reference(backend, device, case):
    require_kernels(backend)
    args = _plus_inputs(**PLUS_CASES[case])
    expected = ref.refine_with_query_mass(*args)
    got = dispatch.BACKENDS[backend].refine_with_query_mass(*_on(device, *args)).cpu()
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.isfinite(got).all()
    if got.numel():
        assert (got - expected).abs().max().item() <= REFINE_ATOL
    padded = args[4] < 0
    assert bool((got[padded] == 0).all()), "a padded query's output is 0"


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_refine_with_query_mass_cluster_without_top_keys_gets_its_centroid_row(backend, device):
    require_kernels(backend)
    q, k, v, valid, a, c, cv, ti, tm, tv, s = _plus_inputs(n=180, clusters=12, topk=16, dk=32, dv=32, seed=3)
    ti, tm, tv = ti.clone(), tm.clone(), tv.clone()
    ti[:, :, 0] = -1  # cluster 0 recomputes no key: m = 0, its members' output is Vc
    tm[:, :, 0] = 0.0
    tv[:, :, 0] = 0.0
    out = (
        dispatch.BACKENDS[backend]
        .refine_with_query_mass(*_on(device, q, k, v, valid, a, c, cv, ti, tm, tv, s))
        .cpu()
    )
    members = a == 0
    assert members.any()
    expected = cv[:, :, 0][:, :, None, :].expand_as(out)[members]
    assert (out[members] - expected).abs().max().item() <= 1e-6


# ---------------------------------------------------------------------------------------------------
# The backward ops: against the reference's autograd, and the same bits twice.


def _backward_args(case: str, seed: int = 0) -> dict:
    """The two backward ops' arguments (the output gradient first) on a case of PLUS_CASES."""
    args = _plus_inputs(**PLUS_CASES[case], seed=seed)
    q, k, v, valid = args[:4]
    g = torch.Generator().manual_seed(seed + 11)
    grad = torch.randn(*q.shape[:-1], v.shape[-1], generator=g)
    # float32 in the backward: ops.py widens the half dtypes before calling the op
    widened = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    window = max(1, q.shape[2] // 5)
    return {
        "refine_with_query_mass_backward": (grad, *widened),
        "banded_attention_backward": (grad, q, k, v, valid, window, args[-1]),
    }


BACKWARD_OPS = ("refine_with_query_mass_backward", "banded_attention_backward")


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("case", list(PLUS_CASES))
def test_backward_ops_match_the_reference_autograd(backend, device, op, case):
    require_kernels(backend)
    from bert_cluster import ops

    args = _backward_args(case)[op]
    expected = getattr(ref, op)(*args)
    got = getattr(ops, op)(*_on(device, *args))
    assert len(got) == len(expected)
    rtol = GRAD_RTOL if PLUS_CASES[case].get("dtype", "fp32") == "fp32" or op.startswith("refine") else 8e-3
    for index, (a, e) in enumerate(zip(got, expected, strict=True)):
        a = a.cpu()
        assert a.dtype == e.dtype == torch.float32 and a.shape == e.shape, (index, a.dtype, a.shape, e.shape)
        assert torch.isfinite(a).all(), f"{op} gradient {index}: not finite"
        if a.numel():
            scale = max(e.abs().max().item(), 1e-6)
            error = (a - e).abs().max().item() / scale
            assert error <= rtol, f"{op} gradient {index}: relative error {error:.3g} > {rtol}"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_backward_ops_give_the_same_bits_twice(backend, device, op):
    require_kernels(backend)
    from bert_cluster import ops

    args = _on(device, *_backward_args("k91", seed=2)[op])
    first, second = getattr(ops, op)(*args), getattr(ops, op)(*args)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), f"{op}: two calls gave different bits"


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_forward_steps_give_the_same_bits_twice(backend, device):
    require_kernels(backend)
    step = dispatch.BACKENDS[backend]
    args = _on(device, *_plus_inputs(n=300, clusters=6, topk=91, dk=32, dv=32, seed=5))
    assert torch.equal(step.refine_with_query_mass(*args), step.refine_with_query_mass(*args))
    q, start = args[0], args[4]
    first, second = step.lloyd_refine(q, start, 6, 3), step.lloyd_refine(q, start, 6, 3)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@cuda_only
@pytest.mark.parametrize("op", ["lloyd_refine", "refine_with_query_mass", *BACKWARD_OPS])
def test_opcheck_on_cuda(backend, device, op):
    require_kernels(backend)
    args = _plus_inputs(n=40, clusters=5, topk=6, dk=16, dv=16)
    on = _on(device, *args)
    cases = {
        "lloyd_refine": (on[0], on[4], 5, 2),
        "refine_with_query_mass": tuple(on),
        **{op_: tuple(_on(device, *a)) for op_, a in _backward_args("empty-row").items()},
    }
    tests = ["test_schema", "test_faketensor"]
    if op == "refine_with_query_mass":
        tests += ["test_autograd_registration", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(getattr(torch.ops.bert_cluster, op).default, cases[op], test_utils=tests)
