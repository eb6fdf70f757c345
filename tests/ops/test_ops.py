"""Every op x backend x device x dtype against ``bert_cluster.reference``, op by op, plus opcheck.

Each case runs the reference pipeline step by step and feeds every kernel op the reference's own inputs
for that step, so a failure names the op. Discrete outputs (hash bits, assignments, centroid hashes,
counts, top-k indices) must match exactly on inputs that the helpers build away from ties: no hash
projection within ``TIE_GAP`` of 0, and every top-k boundary (k-th vs (k+1)-th key) separated by more
than ``TOPK_GAP``. Hamming distances are integers computed exactly on both sides, so their ties follow
the same rule (lowest cluster index) and need no avoidance. Inside a top-k list, two keys whose scores
are within ``TOPK_GAP`` may swap (see ``assert_topk_indices_match`` for why that cannot be avoided).
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

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: Max abs error allowed on the float outputs of an op. All of them are computed in fp32 from the same
#: inputs, so the dtype only changes the input values. Measured max over this file's grid, CPU kernels
#: (2026-11-29; worst op in brackets): fp32 5.2e-7 (topk_refine), fp16 8.3e-7 (topk_refine), bf16 1.1e-6
#: (topk_mass, a sum of up to 2048 weights) -> thresholds about 5-8x that.
OP_ATOL = {"fp32": 4e-6, "fp16": 4e-6, "bf16": 6e-6}
#: Relative part, for sums over many keys (group_queries' means, Vc); the absolute part dominates here.
OP_RTOL = 2e-6
#: End to end (clustered_attention, output cast back to the input dtype), vs the reference backend.
#: Measured max abs error: fp32 2.7e-7, fp16 2.4e-4, bf16 9.8e-4 (one output rounding flips by an ulp)
#: -> thresholds: fp32 2e-6; fp16 and bf16 one ulp at |out| = 2 (outputs stay below 2): 2e-3 and 1.6e-2.
END_ATOL = {"fp32": 2e-6, "fp16": 2e-3, "bf16": 1.6e-2}

#: Inputs are rebuilt until no hash projection lies within this distance of 0 (a different summation
#: order could flip such a bit; the kernels reuse the reference's matmul, but the tests must not rely on it).
TIE_GAP = 1e-3
#: Scores further apart than this cannot swap ranks: 4 fp32 ulps at |score| = 4 (test scores stay below
#: ~4), more than the few ulps by which a GEMM with another summation order can differ.
TOPK_GAP = 2e-6


@dataclass(frozen=True)
class Case:
    """One point of the grid."""

    n: int
    clusters: int
    topk: int
    bits: int
    head_dim: int
    dtype: str
    padded: bool

    def __str__(self) -> str:
        pad = "pad" if self.padded else "nopad"
        return f"N{self.n}-C{self.clusters}-k{self.topk}-B{self.bits}-D{self.head_dim}-{self.dtype}-{pad}"


def _grid() -> list[Case]:
    """Full product of C, k, bits on small N; a covering subset (every value of every axis) on big N."""
    cases = []
    dims, dtypes = (32, 64, 128), tuple(DTYPES)
    index = 0
    for n in (1, 7, 31):
        for clusters in (1, 25, 100):
            for topk in (1, 32, n + 5):
                for bits in (1, 32, 63):
                    cases.append(
                        Case(
                            n, clusters, topk, bits, dims[index % 3], dtypes[(index // 3) % 3], index % 2 == 0
                        )
                    )
                    index += 1
    for n in (128, 513, 2048):
        big = [
            (25, 32, 63, 64, "fp32", True),
            (100, 1, 32, 32, "fp16", False),
            (1, n + 1, 1, 128, "bf16", True),
            (25, 32, 32, 128, "fp32", False),
            (100, n + 1, 63, 32, "bf16", False),
            (25, 1, 1, 64, "fp16", True),
        ]
        if n == 2048:  # the biggest N: a smaller covering set (C=1 with k > N is covered at N=513)
            big = [big[0], big[1], big[4]]
        cases += [Case(n, c, k, b, d, t, p) for c, k, b, d, t, p in big]
    return cases


GRID = _grid()


def _valid(rows: int, n: int, padded: bool) -> torch.Tensor:
    """Row 0 full; row 1 padded on the right and with a hole (both sides when long enough)."""
    valid = torch.ones(rows, n, dtype=torch.bool)
    if padded and n > 1:
        valid[1, n - max(1, n // 3) :] = False
        valid[1, n // 4] = False
        if n > 8:
            valid[1, :2] = False
    return valid


def make_inputs(case: Case, seed: int = 0, rows: int = 2, heads: int = 2):
    """q, k, v (R, H, N, D) in the case's dtype, valid, planes and offsets, with no hash near-ties."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    shape = (rows, heads, case.n, case.head_dim)
    planes = torch.randn(case.bits, case.head_dim, generator=generator)
    offsets = torch.randn(case.bits, generator=generator)
    q = torch.randn(shape, generator=generator).to(dtype)
    for _ in range(100):  # redraw the queries that have a projection near 0
        projections = q.double() @ planes.double().t() + offsets.double()
        near = (projections.abs() < TIE_GAP).any(-1)
        if not bool(near.any()):
            break
        q[near] = torch.randn(int(near.sum()), case.head_dim, generator=generator).to(dtype)
    else:
        raise AssertionError("could not draw queries away from hash ties")
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return q, k, v, _valid(rows, case.n, case.padded), planes, offsets


def _scaled_scores(centroids, keys, valid, scaling) -> torch.Tensor:
    scores = (centroids.float() @ keys.float().transpose(-1, -2)) * scaling
    return scores.masked_fill(~valid[:, None, None, :], -math.inf)


def has_topk_boundary_tie(centroids, keys, valid, topk, scaling) -> bool:
    """Whether some row's k-th and (k+1)-th best keys are within ``TOPK_GAP`` (which set is the top-k is
    then a matter of rounding). Exact ties are allowed: they are an empty cluster's zero centroid, whose
    scores are all exactly 0 on every backend, and go to the lowest index everywhere."""
    masked = _scaled_scores(centroids, keys, valid, scaling)
    if topk >= keys.shape[-2]:
        return False
    top = masked.sort(dim=-1, descending=True, stable=True).values[..., topk - 1 : topk + 1]
    gap = top[..., 0] - top[..., 1]
    return bool(((gap <= TOPK_GAP) & (gap != 0) & (top[..., 1] > -math.inf)).any())


def assert_topk_indices_match(got, expected, centroids, keys, valid, scaling) -> None:
    """Exactly equal, except that two keys whose scores are within ``TOPK_GAP`` may swap ranks.

    With k >= N >= 128 a draw free of such near-ties is out of reach (measured: about 4 pairs within 2e-6
    among 50,000 neighbouring scores), so the order inside a near-tie is left to rounding; every other
    slot, and the set at the top-k boundary (inputs are redrawn until it is separated), must match.
    """
    got, expected = got.cpu(), expected.cpu()
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if torch.equal(got, expected):
        return
    masked = _scaled_scores(centroids, keys, valid, scaling)
    s_got = masked.gather(-1, got.clamp(min=0))
    s_expected = masked.gather(-1, expected.clamp(min=0))
    swapped = (got >= 0) & (expected >= 0) & ((s_got - s_expected).abs() <= TOPK_GAP)
    bad = (got != expected) & ~swapped
    assert not bool(bad.any()), f"topk_indices: {int(bad.sum())} slots differ beyond near-ties"


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(
        actual.cpu(), expected.cpu(), atol=atol, rtol=OP_RTOL, msg=lambda m: f"{what}: {m}"
    )


def _equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    )
    mismatches = int((actual.cpu() != expected.cpu()).sum())
    assert mismatches == 0, f"{what}: {mismatches} of {expected.numel()} entries differ"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("case", GRID, ids=str)
def test_ops_match_reference(case: Case, backend: str, device: str) -> None:
    require_kernels(backend)
    kernels = dispatch.BACKENDS[backend]
    scaling = 1.0 / math.sqrt(case.head_dim)
    for seed in range(20):  # redraw until the top-k boundaries are separated (needed in a few % of cases)
        # one head at N=2048 keeps the reference's (R, H, N, k, D) gather of k > N within ~1 GB
        q, k, v, valid, planes, offsets = make_inputs(case, seed, heads=1 if case.n >= 2048 else 2)
        hashes = ref.hash_queries(q, planes, offsets)
        assignments, centroid_hashes = ref.hamming_kmeans(hashes, valid, case.clusters, 10, case.bits)
        centroids, counts = ref.group_queries(q, assignments, case.clusters)
        if not has_topk_boundary_tie(centroids, k, valid, case.topk, scaling):
            break
    else:
        raise AssertionError("could not draw inputs without a near-tie at the top-k boundary")
    atol = OP_ATOL[case.dtype]
    dev = [t.to(device) for t in (q, k, v, valid, planes, offsets)]
    qd, kd, vd, validd, planesd, offsetsd = dev

    _equal(kernels.hash_queries(qd, planesd, offsetsd), hashes, "hash_queries")

    got_assign, got_centroids = kernels.hamming_kmeans(
        hashes.to(device), validd, case.clusters, 10, case.bits
    )
    _equal(got_assign, assignments, "hamming_kmeans assignments")
    _equal(got_centroids, centroid_hashes, "hamming_kmeans centroids")

    got_centroids, got_counts = kernels.group_queries(qd, assignments.to(device), case.clusters)
    _close(got_centroids, centroids, atol, "group_queries centroids")
    _equal(got_counts, counts, "group_queries counts")

    expected = ref.centroid_attention(centroids, k, v, valid, case.topk, scaling)
    got = kernels.centroid_attention(centroids.to(device), kd, vd, validd, case.topk, scaling)
    _close(got[0], expected[0], atol, "centroid_attention centroid_values")
    assert_topk_indices_match(got[1], expected[1], centroids, k, valid, scaling)
    _close(got[2], expected[2], atol, "centroid_attention topk_mass")
    _close(got[3], expected[3], atol, "centroid_attention topk_values")

    refined = ref.topk_refine(q, k, v, assignments, *expected, scaling)
    got_refined = kernels.topk_refine(
        qd, kd, vd, assignments.to(device), *[t.to(device) for t in expected], scaling
    )
    _close(got_refined, refined, atol, "topk_refine")

    broadcast = ref.broadcast_clusters(expected[0], assignments)
    _close(
        kernels.broadcast_clusters(expected[0].to(device), assignments.to(device)),
        broadcast,
        0.0,
        "broadcast",
    )


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["i-clustered", "clustered"])
def test_clustered_attention_matches_reference_backend(
    backend: str, device: str, dtype: str, mode: str
) -> None:
    """End to end through attention.py, with a mixed batch (one row short enough for exact attention)."""
    require_kernels(backend)
    case = Case(200, 25, 32, 63, 64, dtype, True)
    q, k, v, valid, _, _ = make_inputs(case, seed=1)
    valid[1, 20:] = False  # 20 valid tokens <= C: this row takes exact attention
    base = ClusteredAttentionConfig(clusters=25, topk=32, bits=63, iterations=10, mode=mode)
    expected = clustered_attention(q, k, v, valid, base.replace(backend="reference"))
    got = clustered_attention(
        q.to(device), k.to(device), v.to(device), valid.to(device), base.replace(backend=backend)
    )
    assert got.dtype == q.dtype
    _close(got.float(), expected.float(), END_ATOL[dtype], f"clustered_attention {mode}")


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_topk_at_least_n_is_exact(backend: str, device: str) -> None:
    """Paper property on the kernels: with k >= N improved clustered attention equals exact attention."""
    require_kernels(backend)
    q, k, v, valid, _, _ = make_inputs(Case(64, 4, 64, 63, 32, "fp32", True), seed=2)
    config = ClusteredAttentionConfig(clusters=4, topk=64, backend=backend)
    got = clustered_attention(q.to(device), k.to(device), v.to(device), valid.to(device), config).cpu()
    exact = ref.exact_attention(q, k, v, valid, 1 / math.sqrt(32))
    torch.testing.assert_close(got, exact, atol=2e-6, rtol=2e-6)  # measured 3.6e-7


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("topk", [1, 40, 100, 181, 300, 700])
def test_topk_selection_with_exact_ties(topk: int, backend: str, device: str) -> None:
    """The top-k keys of each centroid, in order, with many exactly equal scores (ties go to the lower key
    index), for k across the kernels' selection regimes (small sets ranked, larger ones partitioned,
    candidate buffers compacted many times over 1,500 keys). Keys and centroids are multiples of 1/2 in
    [-1, 1], so every score is exact in float32 whatever the summation order: the lists must be identical."""
    require_kernels(backend)
    generator = torch.Generator().manual_seed(topk)
    n, clusters, dim = 1500, 40, 16

    def halves(*shape: int) -> torch.Tensor:
        return torch.randint(-2, 3, shape, generator=generator).float() / 2

    keys, values, centroids = halves(2, 3, n, dim), halves(2, 3, n, dim), halves(2, 3, clusters, dim)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, 1100:] = False
    valid[1, :37] = False
    expected = ref.centroid_attention(centroids, keys, values, valid, topk, 0.25)
    got = dispatch.BACKENDS[backend].centroid_attention(
        centroids.to(device), keys.to(device), values.to(device), valid.to(device), topk, 0.25
    )
    _equal(got[1], expected[1], "top-k indices")
    # Sums of k weights in another order: measured max error 6.7e-6 (mass, k=700), 9e-8 (values).
    _close(got[2], expected[2], 2e-5, "top-k mass")
    _close(got[3], expected[3], 1e-6, "top-k values")


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("clusters", [7, 25, 60])
def test_kmeans_matches_the_reference_after_any_rounds(backend: str, device: str, clusters: int) -> None:
    """After its first round the CPU K-means rescans only the centroids the last vote moved (and every
    centroid for the queries whose own centroid moved away): the result after any number of rounds, and
    the final assignment of a run cut short, must be the full scan's. Hashes drawn from a few hundred
    values, so that many queries tie and many centroids settle early; one row padded on both sides."""
    require_kernels(backend)
    generator = torch.Generator().manual_seed(clusters)
    pool = torch.randint(0, 2**20, (300,), generator=generator)
    hashes = pool[torch.randint(0, 300, (2, 3, 700), generator=generator)]
    valid = torch.ones(2, 700, dtype=torch.bool)
    valid[1, :40] = False
    valid[1, 600:] = False
    kernels = dispatch.BACKENDS[backend]
    for rounds in (0, 1, 2, 3, 5, 8, 13):
        assignments, centroid_hashes = ref.hamming_kmeans(hashes, valid, clusters, rounds, 20)
        got_assign, got_centroids = kernels.hamming_kmeans(
            hashes.to(device), valid.to(device), clusters, rounds, 20
        )
        _equal(got_assign, assignments, f"assignments after {rounds} rounds")
        _equal(got_centroids, centroid_hashes, f"centroids after {rounds} rounds")


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_kmeans_with_counts_in_global_memory_matches_the_reference(backend: str, device: str) -> None:
    """From C = 177 the CUDA K-means keeps its member and bit counts in global memory (they no longer fit
    in shared memory beside the centroids): C = 200, with more distinct hashes than clusters, must give the
    reference's assignments and centroids. On the CPU kernels the same case is the stand-in."""
    require_kernels(backend)
    generator = torch.Generator().manual_seed(200)
    hashes = torch.randint(0, 2**40, (1, 2, 3000), generator=generator)
    valid = torch.ones(1, 3000, dtype=torch.bool)
    valid[0, 2600:] = False
    for rounds in (0, 3):
        assignments, centroid_hashes = ref.hamming_kmeans(hashes, valid, 200, rounds, 40)
        got = dispatch.BACKENDS[backend].hamming_kmeans(hashes.to(device), valid.to(device), 200, rounds, 40)
        _equal(got[0], assignments, f"assignments after {rounds} rounds at C = 200")
        _equal(got[1], centroid_hashes, f"centroids after {rounds} rounds at C = 200")


@pytest.mark.cuda
def test_cuda_kmeans_launches_at_the_largest_admitted_cluster_count() -> None:
    """C = 4010 is the most the CUDA K-means admits (48 KiB of shared memory): it must launch and match the
    reference; C = 4011 is refused with the limit named."""
    require_kernels("cuda")
    generator = torch.Generator().manual_seed(4010)
    hashes = torch.randint(0, 2**40, (1, 1, 5000), generator=generator)
    valid = torch.ones(1, 5000, dtype=torch.bool)
    expected = ref.hamming_kmeans(hashes, valid, 4010, 1, 40)
    got = dispatch.BACKENDS["cuda"].hamming_kmeans(hashes.cuda(), valid.cuda(), 4010, 1, 40)
    _equal(got[0], expected[0], "assignments at C = 4010")
    _equal(got[1], expected[1], "centroids at C = 4010")
    with pytest.raises(ValueError, match="supports up to 4010 clusters"):
        dispatch.BACKENDS["cuda"].hamming_kmeans(hashes.cuda(), valid.cuda(), 4011, 1, 40)


def _small_args(device: str):
    case = Case(9, 3, 4, 8, 8, "fp32", True)
    q, k, v, valid, planes, offsets = (t.to(device) for t in make_inputs(case, seed=3))
    hashes = ref.hash_queries(q, planes, offsets)
    assignments, _ = ref.hamming_kmeans(hashes, valid, 3, 2, 8)
    centroids, _ = ref.group_queries(q, assignments, 3)
    attended = ref.centroid_attention(centroids, k, v, valid, 4, 0.5)
    return {
        "hash_queries": (q, planes, offsets),
        "hamming_kmeans": (hashes, valid, 3, 2, 8),
        "group_queries": (q, assignments, 3),
        "centroid_attention": (centroids, k, v, valid, 4, 0.5),
        "topk_refine": (q, k, v, assignments, *attended, 0.5),
        "broadcast_clusters": (attended[0], assignments),
        "banded_attention": (q, k, v, valid, 2, 0.5),
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(
    "op",
    [
        "hash_queries",
        "hamming_kmeans",
        "group_queries",
        "centroid_attention",
        "topk_refine",
        "broadcast_clusters",
        "banded_attention",
    ],
)
def test_opcheck(op: str, device: str) -> None:
    require_kernels("cpu" if device == "cpu" else "cuda")
    from bert_cluster import ops

    torch.library.opcheck(getattr(torch.ops.bert_cluster, op).default, _small_args(device)[op])
    assert op in ops.OPS


def test_fake_kernels_trace_without_graph_breaks() -> None:
    """The op chain compiles as one graph (fake kernels give every shape), dynamic N included."""
    require_kernels("cpu")
    from bert_cluster import ops

    def pipeline(q, k, v, valid, planes, offsets):
        hashes = ops.hash_queries(q, planes, offsets)
        assignments, _ = ops.hamming_kmeans(hashes, valid, 3, 2, 8)
        centroids, _ = ops.group_queries(q, assignments, 3)
        attended = ops.centroid_attention(centroids, k, v, valid, 4, 0.5)
        return ops.topk_refine(q, k, v, assignments, *attended, 0.5)

    torch._dynamo.reset()
    compiled = torch.compile(pipeline, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (9, 17):
        args = make_inputs(Case(n, 3, 4, 8, 8, "fp32", True), seed=4)
        torch.testing.assert_close(compiled(*args), pipeline(*args))


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda ops, t: ops.hash_queries(t["q"].int(), t["planes"], t["offsets"]), TypeError),
        (lambda ops, t: ops.hash_queries(t["q"], t["planes"][:, :3], t["offsets"]), ValueError),
        (lambda ops, t: ops.hamming_kmeans(t["hashes"], t["valid"], 0, 2, 8), ValueError),
        (lambda ops, t: ops.hamming_kmeans(t["hashes"], t["valid"], 3, 2, 64), ValueError),
        (lambda ops, t: ops.hamming_kmeans(t["hashes"], t["valid"].int(), 3, 2, 8), TypeError),
        (lambda ops, t: ops.group_queries(t["q"], t["hashes"] + 5, 3), ValueError),
        (lambda ops, t: ops.centroid_attention(t["q"], t["q"], t["q"], t["valid"], -1, 0.5), ValueError),
        (
            lambda ops, t: ops.banded_attention(t["q"], t["q"][..., :4], t["q"], t["valid"], 2, 0.5),
            ValueError,
        ),
        (lambda ops, t: ops.banded_attention(t["q"], t["q"], t["q"], t["valid"], -1, 0.5), ValueError),
        (lambda ops, t: ops.banded_attention(t["q"], t["q"], t["q"].double(), t["valid"], 2, 0.5), TypeError),
    ],
)
def test_bad_input_raises(call, error) -> None:
    require_kernels("cpu")
    from bert_cluster import ops

    q, _, _, valid, planes, offsets = make_inputs(Case(9, 3, 4, 8, 8, "fp32", True), seed=5)
    hashes = ref.hash_queries(q, planes, offsets)
    tensors = {"q": q, "planes": planes, "offsets": offsets, "valid": valid, "hashes": hashes}
    with pytest.raises(error):
        call(ops, tensors)


def test_same_seed_same_output_on_every_backend() -> None:
    """Planes come from attention.hash_planes on the CPU: two runs and two backends agree exactly on bits."""
    require_kernels("cpu")
    planes_a, offsets_a = hash_planes(7, 3, 63, 64)
    planes_b, offsets_b = hash_planes(7, 3, 63, 64)
    assert torch.equal(planes_a, planes_b) and torch.equal(offsets_a, offsets_b)
    q, k, v, valid, _, _ = make_inputs(Case(300, 25, 32, 63, 64, "fp32", True), seed=6)
    config = ClusteredAttentionConfig(seed=7, backend="cpu")
    first = clustered_attention(q, k, v, valid, config, layer=3)
    second = clustered_attention(q, k, v, valid, config, layer=3)
    assert torch.equal(first, second)


def test_loader_reports_kernels() -> None:
    from bert_cluster import _build, ops

    state = ops.load_kernels()
    info = _build.build_info()
    assert info["kernels_loaded"] == state["loaded"]
    names = [entry["backend"] for entry in info["backends"]]
    assert names == ["cuda", "cpu", "reference"]
    if state["loaded"]:
        assert info["auto_backend_cpu"] == "cpu"
