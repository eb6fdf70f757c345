"""i-clustered+ (issue 13): its two steps (``lloyd_refine``, ``refine_with_query_mass``) in the reference
and the CPU kernels, and the mode end to end.

lloyd_refine, kernel vs reference: the means of one partition are summed in query order on both sides (bit
for bit); the dot products of the assignment are summed in different orders (a GEMM in the reference, a
fused loop in the kernel), so a query within a few ulps of a tie may go either way. Exact agreement is
therefore checked on inputs with a clear margin (blobs), and on random inputs every disagreement must be a
near tie.
"""

from __future__ import annotations

import math

import pytest
import torch

from bert_cluster import dispatch
from bert_cluster import reference as ref
from bert_cluster.attention import clustered_attention, plus_lloyd_rounds
from bert_cluster.config import ClusteredAttentionConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Max abs difference of the centroids (kernel vs reference) for one partition: both sum the same fp32
#: numbers in the same order, measured 0.0 on every dtype -> threshold 0 (bit for bit).
CENTROID_ATOL = 0.0
#: A disagreement on random inputs must be a near tie: the reference's distances to the two clusters
#: differ by at most this (relative to the distance scale). Measured max over the grid: see
#: test_kernel_disagrees_only_on_near_ties (0 disagreements in 20 draws of 4,096 queries on fp32).
TIE_RTOL = 1e-5
#: i-clustered+ end to end, CPU kernels vs the reference backend (output in the input dtype).
#: Measured max abs error: fp32 4.8e-7, fp16 4.9e-4, bf16 3.9e-3 (one rounding of the output)
#: -> thresholds ~4x: fp32 2e-6; fp16 and bf16 one ulp at |out| = 2: 2e-3 and 1.6e-2.
END_ATOL = {"fp32": 2e-6, "fp16": 2e-3, "bf16": 1.6e-2}
#: With k >= N i-clustered+ is exact attention. Measured max abs error vs exact_attention 3.6e-7 (fp32).
EXACT_ATOL = 2e-6
#: refine_with_query_mass, CPU kernel vs reference on the reference's own inputs (all computed in fp32).
#: Measured max abs error 4.8e-7 on fp32, fp16 and bf16 inputs -> 4e-6 (as OP_ATOL in tests/ops).
REFINE_ATOL = 4e-6


def _cpu_or_skip() -> None:
    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"cpu kernels unavailable: {why}")


def blobs(rows=2, heads=3, n=96, dk=16, centres=6, spread=0.05, seed=0):
    """Queries drawn around ``centres`` well-separated points per (row, head), and a random partition."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(rows, heads, centres, dk, generator=g) * 3
    which = torch.randint(0, centres, (rows, heads, n), generator=g)
    queries = centre.gather(2, which[..., None].expand(-1, -1, -1, dk))
    queries = queries + spread * torch.randn(rows, heads, n, dk, generator=g)
    return queries, which


def sse(queries, assignments, centroids):
    """The K-means objective: squared distances of valid queries to their centroids, per (row, head)."""
    picked = centroids.gather(2, assignments.clamp(min=0)[..., None].expand(-1, -1, -1, queries.shape[-1]))
    return ((queries.float() - picked).pow(2).sum(-1) * (assignments >= 0)).sum(-1)


# ---------------------------------------------------------------------------------------------------
# The reference's rules


def test_zero_iterations_gives_the_means_of_the_partition():
    queries, _ = blobs()
    start = torch.randint(0, 8, queries.shape[:-1])
    assignments, centroids, counts = ref.lloyd_refine(queries, start, 8, 0)
    means, sizes = ref.group_queries(queries, start, 8)
    assert torch.equal(assignments, start)
    torch.testing.assert_close(centroids, means, atol=1e-6, rtol=1e-6)
    assert torch.equal(counts, sizes)


def test_lloyd_recovers_well_separated_blobs_from_a_perturbed_partition():
    # What Lloyd is for here: the hash partition is roughly right; a quarter of the queries in the wrong
    # cluster. One round puts every query back with its blob (the blobs are far apart).
    queries, truth = blobs(centres=4, spread=0.01)
    g = torch.Generator().manual_seed(1)
    wrong = torch.rand(truth.shape, generator=g) < 0.25
    start = torch.where(wrong, torch.randint(0, 4, truth.shape, generator=g), truth)
    assert not torch.equal(start, truth)
    assignments, _, counts = ref.lloyd_refine(queries, start, 4, 20)
    assert torch.equal(assignments, truth)
    assert torch.equal(counts, torch.nn.functional.one_hot(truth, 4).sum(-2).float())


def test_each_round_never_increases_the_kmeans_objective():
    g = torch.Generator().manual_seed(3)
    queries = torch.randn(2, 4, 200, 32, generator=g)
    assignments = torch.randint(0, 10, queries.shape[:-1], generator=g)
    _, centroids, _ = ref.lloyd_refine(queries, assignments, 10, 0)
    before = sse(queries, assignments, centroids)
    for _ in range(4):
        assignments, centroids, _ = ref.lloyd_refine(queries, assignments, 10, 1)
        after = sse(queries, assignments, centroids)
        assert bool((after <= before * (1 + 1e-6)).all()), (before, after)
        before = after


def test_padding_stays_padding_and_empty_clusters_never_win():
    queries, _ = blobs(rows=1, heads=2, n=40)
    start = torch.randint(0, 3, queries.shape[:-1])  # clusters 3..7 start empty
    start[0, :, 30:] = -1
    assignments, centroids, counts = ref.lloyd_refine(queries, start, 8, 5)
    assert bool((assignments[0, :, 30:] == -1).all())
    assert bool((assignments[0, :, :30] >= 0).all()) and bool((assignments < 3).all())
    assert bool((counts[..., 3:] == 0).all()) and bool((centroids[..., 3:, :] == 0).all())


def test_ties_go_to_the_lowest_cluster_index():
    # Query 2 lies exactly halfway between the means of clusters 0 and 1.
    queries = torch.tensor([[[[0.0, 0.0], [2.0, 0.0], [1.0, 0.0]]]])
    start = torch.tensor([[[0, 1, 1]]])
    # Means: c0 = (0, 0), c1 = (1.5, 0): query 2 at distance 1 vs 0.5 -> stays in 1. Make it a tie instead:
    start = torch.tensor([[[0, 1, 2]]])
    queries = torch.tensor([[[[0.0, 0.0], [2.0, 0.0], [1.0, 0.0]]]])
    assignments, _, _ = ref.lloyd_refine(queries, start, 3, 1)
    assert assignments.tolist() == [[[0, 1, 2]]]  # each query is its own mean: distance 0 wins
    start = torch.tensor([[[0, 1, 0]]])  # c0 = (0.5, 0), c1 = (2, 0): query 2 at 0.5 vs 1 -> 0
    assert ref.lloyd_refine(queries, start, 2, 1)[0].tolist() == [[[0, 1, 0]]]
    queries = torch.tensor([[[[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [1.0, 0.0]]]])
    start = torch.tensor([[[0, 1, 0, 1]]])  # c0 = (0.5, 0), c1 = (1.5, 0): queries 2, 3 tie -> cluster 0
    assignments, _, counts = ref.lloyd_refine(queries, start, 2, 1)
    assert assignments.tolist() == [[[0, 1, 0, 0]]]
    assert counts.tolist() == [[[3.0, 1.0]]]


def test_a_fixed_point_gives_the_same_result_as_more_rounds():
    queries, _ = blobs(seed=5)
    start = torch.randint(0, 6, queries.shape[:-1])
    few = ref.lloyd_refine(queries, start, 6, 30)
    many = ref.lloyd_refine(queries, start, 6, 300)
    for a, b in zip(few, many, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# The CPU kernel against the reference


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_kernel_matches_the_reference_on_separated_inputs(dtype, iterations):
    _cpu_or_skip()
    from bert_cluster import ops

    queries, _ = blobs(rows=2, heads=3, n=257, dk=32, centres=9, seed=7)
    queries = queries.to(DTYPES[dtype])
    start = torch.randint(0, 12, queries.shape[:-1], generator=torch.Generator().manual_seed(2))
    start[1, :, 200:] = -1  # padding
    expected = ref.lloyd_refine(queries, start, 12, iterations)
    got = ops.lloyd_refine(queries, start, 12, iterations)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[2], expected[2])
    assert (got[1] - expected[1]).abs().max().item() <= CENTROID_ATOL
    assert torch.equal(start, start.clone())  # the input is not modified (the op is functional)


def _near_tie(queries, centroids, counts, query, a, b) -> bool:
    """Whether the reference's distances of ``query`` to clusters a and b are equal up to TIE_RTOL."""
    c = centroids.double()
    d = (c * c).sum(-1) - 2 * (queries.double() @ c.transpose(-1, -2))
    scale = float(queries.double().pow(2).sum(-1).max()) + float((c * c).sum(-1).max())
    return abs(float(d[query, a] - d[query, b])) <= TIE_RTOL * scale


@pytest.mark.parametrize("seed", range(4))
def test_kernel_disagrees_only_on_near_ties(seed):
    _cpu_or_skip()
    from bert_cluster import ops

    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(1, 4, 1024, 64, generator=g)
    start = torch.randint(0, 25, queries.shape[:-1], generator=g)
    expected, centroids, counts = ref.lloyd_refine(queries, start, 25, 0)
    want = ref.lloyd_refine(queries, start, 25, 1)[0]
    got = ops.lloyd_refine(queries, start, 25, 1)[0]
    for r, h, i in (got != want).nonzero().tolist():
        assert _near_tie(
            queries[r, h], centroids[r, h], counts[r, h], i, int(got[r, h, i]), int(want[r, h, i])
        ), f"query {(r, h, i)}: kernel {int(got[r, h, i])}, reference {int(want[r, h, i])}, not a tie"


def test_kernel_refuses_bad_arguments():
    _cpu_or_skip()
    from bert_cluster import ops

    queries = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="assignments must be -1 or in 0..2"):
        ops.lloyd_refine(queries, torch.full((1, 2, 8), 3), 3, 1)
    with pytest.raises(ValueError, match="assignments must have shape"):
        ops.lloyd_refine(queries, torch.zeros(1, 2, 7, dtype=torch.long), 3, 1)
    with pytest.raises(ValueError, match="iterations must be >= 0"):
        ops.lloyd_refine(queries, torch.zeros(1, 2, 8, dtype=torch.long), 3, -1)
    with pytest.raises(TypeError, match="queries must be float32, float16 or bfloat16"):
        ops.lloyd_refine(queries.double(), torch.zeros(1, 2, 8, dtype=torch.long), 3, 1)


def test_opcheck():
    _cpu_or_skip()
    from bert_cluster import ops

    ops._ensure_loaded()
    queries, _ = blobs(rows=1, heads=2, n=33, dk=8)
    start = torch.randint(0, 5, queries.shape[:-1])
    torch.library.opcheck(torch.ops.bert_cluster.lloyd_refine.default, (queries, start, 5, 2))


# ---------------------------------------------------------------------------------------------------
# The mode end to end


def _qkv(rows=2, heads=4, n=200, dk=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, heads, n, dk, generator=g).to(dtype) for _ in range(3)]


def test_the_mode_is_a_valid_setting_and_round_trips():
    config = ClusteredAttentionConfig(mode="i-clustered+")
    assert ClusteredAttentionConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_with_k_at_least_n_it_is_exact_attention(backend):
    if backend == "cpu":
        _cpu_or_skip()
    q, k, v = _qkv(n=150)
    valid = torch.ones(2, 150, dtype=torch.bool)
    valid[1, 120:] = False
    config = ClusteredAttentionConfig(clusters=10, topk=150, mode="i-clustered+", backend=backend)
    out = clustered_attention(q, k, v, valid, config)
    exact = ref.exact_attention(q, k, v, valid, 1 / math.sqrt(32))
    assert (out - exact).abs().max().item() <= EXACT_ATOL


@pytest.mark.parametrize("mode", ["i-clustered+", "i-clustered"])
def test_rows_whose_top_k_holds_every_key_get_the_exact_gradient(mode):
    # C < valid length <= k (a 29-token sentence at C = 4, k = 32): every valid key is in every cluster's
    # top-k, so the output is exact attention and so must be its gradient. i-clustered+ gave nan in the
    # query and key gradients of such rows (log(1 - m_j) at m_j = 1 in the backward).
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 3, 29, 16) for _ in range(3))
    valid = torch.ones(2, 29, dtype=torch.bool)
    valid[1, 22:] = False
    config = ClusteredAttentionConfig(clusters=4, topk=32, mode=mode, min_length=0, backend="reference")
    grads = []
    for attend in (
        lambda q, k, v: clustered_attention(q, k, v, valid, config),
        lambda q, k, v: ref.exact_attention(q, k, v, valid, 1 / math.sqrt(16)),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for clustered, exact in zip(*grads, strict=True):
        assert torch.isfinite(clustered).all()
        # Measured max abs difference 3.6e-7 (both modes, q, k and v): as the outputs, EXACT_ATOL.
        assert (clustered - exact).abs().max().item() <= EXACT_ATOL


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_kernels_match_the_reference_end_to_end(dtype):
    _cpu_or_skip()
    q, k, v = _qkv(dtype=DTYPES[dtype], seed=4)
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[0, 170:] = False
    settings = dict(clusters=12, topk=16, mode="i-clustered+", seed=3)
    cpu = clustered_attention(q, k, v, valid, ClusteredAttentionConfig(**settings, backend="cpu"))
    reference = clustered_attention(q, k, v, valid, ClusteredAttentionConfig(**settings, backend="reference"))
    assert cpu.dtype == DTYPES[dtype]
    assert (cpu.float() - reference.float()).abs().max().item() <= END_ATOL[dtype]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_same_seed_same_output_and_rows_do_not_depend_on_the_batch(backend):
    if backend == "cpu":
        _cpu_or_skip()
    q, k, v = _qkv(seed=6)
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[1, 150:] = False
    config = ClusteredAttentionConfig(clusters=16, topk=8, mode="i-clustered+", seed=11, backend=backend)
    first = clustered_attention(q, k, v, valid, config)
    assert torch.equal(first, clustered_attention(q, k, v, valid, config))
    alone = clustered_attention(q[1:, :, :150], k[1:, :, :150], v[1:, :, :150], None, config)
    # Batched products block a batch differently from one row (as for i-clustered): measured max
    # difference 1.5e-8 (reference), 1.2e-7 (kernels; i-clustered: 1.5e-7) -> 1e-6.
    assert (first[1, :, :150] - alone[0]).abs().max().item() <= 1e-6
    other_seed = clustered_attention(q, k, v, valid, config.replace(seed=12))
    assert not torch.equal(first, other_seed)


def test_plus_spends_about_one_round_of_25_clusters_on_lloyd():
    # ceil(25 / C) rounds, at most 3: the rule attention.PLUS_LLOYD_WORK documents.
    assert [plus_lloyd_rounds(c) for c in (1, 8, 10, 12, 13, 24, 25, 100, 336)] == [3, 3, 3, 3, 2, 2, 1, 1, 1]


def test_lloyd_rounds_bring_the_output_closer_to_exact_attention():
    # Queries with cluster structure that the hashes only partly see: the refined partition is closer to
    # the queries, hence (Proposition 1) to exact attention. Measured on this draw (C=8, k=8, 63 bits):
    # relative error i-clustered 0.171, i-clustered+ 0.128 (ratio 0.75) -> required ratio < 0.9.
    queries, _ = blobs(rows=1, heads=4, n=256, dk=32, centres=8, spread=0.3, seed=9)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(1, 4, 256, 32, generator=g), torch.randn(1, 4, 256, 32, generator=g)
    exact = ref.exact_attention(queries, k, v, torch.ones(1, 256, dtype=torch.bool), 1 / math.sqrt(32))

    def error(mode):
        config = ClusteredAttentionConfig(clusters=8, topk=8, mode=mode, backend="reference")
        out = clustered_attention(queries, k, v, None, config)
        return float((out - exact).norm() / exact.norm())

    assert plus_lloyd_rounds(8) >= 1
    assert error("i-clustered+") < 0.9 * error("i-clustered")


# ---------------------------------------------------------------------------------------------------
# refine_with_query_mass


def _pipeline_inputs(dtype=torch.float32, seed=0, n=180, clusters=12, topk=16):
    """The inputs refine_with_query_mass gets inside i-clustered+, from the reference steps."""
    q, k, v = _qkv(n=n, seed=seed, dtype=dtype)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, n - 40 :] = False
    scaling = 1 / math.sqrt(q.shape[-1])
    hashes = ref.hash_queries(q, torch.randn(63, q.shape[-1]), torch.randn(63))
    assignments, _ = ref.hamming_kmeans(hashes, valid, clusters, 10, 63)
    assignments, centroids, _ = ref.lloyd_refine(q, assignments, clusters, 2)
    cv, ti, tm, tv = ref.centroid_attention(centroids, k, v, valid, topk, scaling)
    return q, k, v, valid, assignments, centroids, cv, ti, tm, tv, scaling


def test_a_query_equal_to_its_centroid_gets_the_centroid_mass():
    # Clusters of identical queries: every query is its centroid, so its own mass is m_j and the output is
    # i-clustered's. Measured max difference to topk_refine 2.4e-7 -> 2e-6.
    g = torch.Generator().manual_seed(4)
    distinct = torch.randn(1, 2, 6, 16, generator=g)
    which = torch.randint(0, 6, (1, 2, 60), generator=g)
    q = distinct.gather(2, which[..., None].expand(-1, -1, -1, 16))
    k, v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
    valid = torch.ones(1, 60, dtype=torch.bool)
    centroids, _ = ref.group_queries(q, which, 6)
    cv, ti, tm, tv = ref.centroid_attention(centroids, k, v, valid, 8, 0.25)
    plus = ref.refine_with_query_mass(q, k, v, valid, which, centroids, cv, ti, tm, tv, 0.25)
    paper = ref.topk_refine(q, k, v, which, cv, ti, tm, tv, 0.25)
    assert (plus - paper).abs().max().item() <= 2e-6


def _own_mass(q, k, valid, a, c, ti, tm, s):
    """m_i as refine_with_query_mass estimates it: with values 1 on every key and Vc = Vtop (no rest part),
    its output is m_i * 1 + (1 - m_i) * 0."""
    ones = torch.ones(*k.shape[:-1], 1)
    same = torch.ones(*tm.shape, 1)
    return ref.refine_with_query_mass(q, k, ones, valid, a, c, same, ti, tm, same, s)[..., 0]


def test_the_query_mass_tracks_the_exact_mass():
    # The point of the step: each query's estimated share of attention on its cluster's top-k keys is
    # closer to its exact share than the centroid's m_j is.
    q, k, v, valid, a, c, cv, ti, tm, tv, s = _pipeline_inputs(seed=8)
    n = q.shape[2]
    top = ti.gather(2, a.clamp(min=0)[..., None].expand(-1, -1, -1, ti.shape[-1]))
    in_top = torch.zeros(*a.shape, n, dtype=torch.bool).scatter_(-1, top.clamp(min=0), top >= 0)
    scores = (q @ k.transpose(-1, -2) * s).masked_fill(~valid[:, None, None, :], -math.inf)
    exact_mass = (torch.softmax(scores, -1) * in_top).sum(-1)
    member = a >= 0
    estimated = _own_mass(q, k, valid, a, c, ti, tm, s)
    err_plus = (estimated - exact_mass)[member].abs().mean().item()
    err_paper = (tm.gather(2, a.clamp(min=0)) - exact_mass)[member].abs().mean().item()
    # Measured on this draw: mean |m - exact| 0.031 (per query) vs 0.058 (centroid's) -> require < 0.75x.
    assert err_plus < 0.75 * err_paper, (err_plus, err_paper)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_refine_kernel_matches_the_reference(dtype):
    _cpu_or_skip()
    from bert_cluster import ops

    args = _pipeline_inputs(DTYPES[dtype], seed=2)
    expected = ref.refine_with_query_mass(*args)
    got = ops.refine_with_query_mass(*args)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= REFINE_ATOL
    padded = args[4] < 0
    assert bool((got[padded] == 0).all())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_cluster_without_top_keys_gets_the_centroid_row(backend):
    if backend == "cpu":
        _cpu_or_skip()
    q, k, v, valid, a, c, cv, ti, tm, tv, s = _pipeline_inputs(seed=3)
    ti = ti.clone()
    ti[:, :, 0] = -1  # cluster 0 recomputes no key: m = 0, the output is its centroid row Vc
    tm, tv = tm.clone(), tv.clone()
    tm[:, :, 0] = 0.0
    tv[:, :, 0] = 0.0
    step = ref.refine_with_query_mass if backend == "reference" else _ops().refine_with_query_mass
    out = step(q, k, v, valid, a, c, cv, ti, tm, tv, s)
    members = a == 0
    expected = cv[:, :, 0][:, :, None, :].expand_as(out)[members]
    assert members.any()
    assert (out[members] - expected).abs().max().item() <= 1e-6


def _ops():
    from bert_cluster import ops

    return ops


def test_refine_opcheck():
    _cpu_or_skip()
    args = _pipeline_inputs(n=40, clusters=5, topk=6)
    _ops()._ensure_loaded()
    torch.library.opcheck(torch.ops.bert_cluster.refine_with_query_mass.default, args)


def test_the_refine_kernel_refuses_bad_arguments():
    _cpu_or_skip()
    q, k, v, valid, a, c, cv, ti, tm, tv, s = _pipeline_inputs(n=40, clusters=5, topk=6)
    step = _ops().refine_with_query_mass
    with pytest.raises(ValueError, match="centroids must be"):
        step(q, k, v, valid, a, c[:, :, :4], cv, ti, tm, tv, s)
    with pytest.raises(ValueError, match="valid must have shape"):
        step(q, k, v, valid[:, :30], a, c, cv, ti, tm, tv, s)
    with pytest.raises(ValueError, match="topk_indices must be -1 or in"):
        step(q, k, v, valid, a, c, cv, ti + 1000, tm, tv, s)


def test_the_new_steps_are_kernels_on_both_backends():
    """lloyd_refine, refine_with_query_mass and their backward are compiled for the CPU and CUDA (issue 38:
    kernels/cuda/plus.cu), as the band's backward and the in-place centroid attention backward, so they are
    in ops.OPS, which every kernel backend must register; the fused ops and dropout's own step stay CPU
    only. (Before, CUDA ran the reference's tensor ops for them.)"""
    from bert_cluster import _loader, ops

    dropout_ops = {"centroid_rest", "centroid_rest_backward"}
    assert set(ops.CPU_ONLY_OPS) == {"clustered_heads", "clustered_heads_partition"} | dropout_ops
    for op in (
        "lloyd_refine",
        "refine_with_query_mass",
        "refine_with_query_mass_backward",
        "banded_attention_backward",
        "centroid_attention_backward_into",
    ):
        assert op in ops.OPS
        assert getattr(dispatch.CudaKernelBackend, op) is getattr(ops, op)
    assert dispatch.CudaKernelBackend.lloyd_refine is not ref.lloyd_refine
    assert dispatch.CudaKernelBackend.refine_with_query_mass is not ref.refine_with_query_mass
    _cpu_or_skip()
    assert all(_loader.has_kernel(op, "CPU") for op in ops.CPU_ONLY_OPS)
    assert ops.missing_kernels("CPU") == []
