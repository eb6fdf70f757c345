"""Rules every kernel backend keeps beyond matching the reference: results independent of the thread count,
one message for mismatched head dims, out-of-range indices rejected, strided (HF-layout) inputs read in place,
ties to the lowest key index across tiles, odd head dims and Dv != Dk."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import kernel_backends, require_kernels

from bert_cluster import dispatch
from bert_cluster import reference as ref
from bert_cluster.attention import clustered_attention, hash_planes
from bert_cluster.config import ClusteredAttentionConfig


def _qkv(rows, heads, n, dk, dv=None, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, n, dk, generator=generator).to(dtype)
    k = torch.randn(rows, heads, n, dk, generator=generator).to(dtype)
    v = torch.randn(rows, heads, n, dv or dk, generator=generator).to(dtype)
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[-1, n - n // 4 :] = False
    return q, k, v, valid


def _pipeline(q, k, v, valid, clusters=25, topk=32, bits=63):
    """Every op of the CPU kernels on one input, in order: a dict of outputs."""
    from bert_cluster import ops

    planes, offsets = hash_planes(0, 0, bits, q.shape[-1])
    scaling = 1 / math.sqrt(q.shape[-1])
    out = {"hash": ops.hash_queries(q, planes, offsets)}
    out["assign"], out["centroid_hashes"] = ops.hamming_kmeans(out["hash"], valid, clusters, 10, bits)
    out["centroids"], out["counts"] = ops.group_queries(q, out["assign"], clusters)
    attended = ops.centroid_attention(out["centroids"], k, v, valid, topk, scaling)
    for name, tensor in zip(("cv", "topk_indices", "mass", "topk_values"), attended, strict=True):
        out[name] = tensor
    out["refined"] = ops.topk_refine(q, k, v, out["assign"], *attended, scaling)
    out["broadcast"] = ops.broadcast_clusters(attended[0], out["assign"])
    out["band"] = ops.banded_attention(q, k, v, valid, 64, scaling)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_do_not_depend_on_the_thread_count(dtype) -> None:
    """Issue 11 item 9: bit-identical outputs with 1, 2 and 3 threads (the work splits differently)."""
    require_kernels("cpu")
    q, k, v, valid = _qkv(2, 4, 1100, 64, seed=3, dtype=dtype)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            with torch.inference_mode():
                result = _pipeline(q, k, v, valid)
                result["end_to_end"] = clustered_attention(
                    q, k, v, valid, ClusteredAttentionConfig(backend="cpu")
                )
            outputs.append(result)
    finally:
        torch.set_num_threads(threads)
    for other in outputs[1:]:
        for name, tensor in outputs[0].items():
            assert torch.equal(tensor, other[name]), f"{name} changed with the thread count"


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_mismatched_head_dims_give_one_message(backend: str, device: str) -> None:
    """Issue 11 item 6: the same ValueError on every kernel op that takes queries (or centroids) and keys."""
    require_kernels(backend)
    from bert_cluster import ops

    q, _, v, valid = (t.to(device) for t in _qkv(1, 2, 20, 8, seed=4))
    k = torch.randn(1, 2, 20, 12, device=device)
    message = "query and key must have the same head dim, got Dq=8 and Dk=12"
    centroids = torch.zeros(1, 2, 3, 8, device=device)
    assign = torch.zeros(1, 2, 20, dtype=torch.long, device=device)
    attended = (
        torch.zeros(1, 2, 3, 8, device=device),
        torch.zeros(1, 2, 3, 4, dtype=torch.long, device=device),
        torch.zeros(1, 2, 3, device=device),
        torch.zeros(1, 2, 3, 8, device=device),
    )
    with pytest.raises(ValueError, match=message):
        ops.centroid_attention(centroids, k, v, valid, 4, 0.5)
    with pytest.raises(ValueError, match=message):
        ops.topk_refine(q, k, v, assign, *attended, 0.5)
    with pytest.raises(ValueError, match=message):
        ops.banded_attention(q, k, v, valid, 2, 0.5)


def test_out_of_range_assignments_and_indices_are_rejected() -> None:
    """The CPU kernels raise ValueError (CUDA fails a device-side assertion: scripts/gpu_checks.py)."""
    require_kernels("cpu")
    from bert_cluster import ops

    q, k, v, valid = _qkv(1, 2, 30, 8, seed=5)
    hashes = ref.hash_queries(q, *hash_planes(0, 0, 8, 8))
    assign, _ = ref.hamming_kmeans(hashes, valid, 3, 2, 8)
    attended = list(ref.centroid_attention(ref.group_queries(q, assign, 3)[0], k, v, valid, 4, 0.5))
    for bad in (3, -2):
        broken = assign.clone()
        broken[0, 1, 5] = bad
        with pytest.raises(ValueError, match="assignments must be -1 or in 0..2"):
            ops.group_queries(q, broken, 3)
        with pytest.raises(ValueError, match="assignments must be -1 or in 0..2"):
            ops.topk_refine(q, k, v, broken, *attended, 0.5)
        with pytest.raises(ValueError, match="assignments must be -1 or in 0..2"):
            ops.broadcast_clusters(attended[0], broken)
    for bad in (30, -2):
        indices = attended[1].clone()
        indices[0, 0, 1, 0] = bad
        with pytest.raises(ValueError, match="topk_indices must be -1 or in 0..29"):
            ops.topk_refine(q, k, v, assign, attended[0], indices, *attended[2:], 0.5)


def test_hf_layout_inputs_are_read_in_place() -> None:
    """(B, H, L, D) views of a (B, L, H, D) tensor, as transformers passes them, give the same bits."""
    require_kernels("cpu")
    generator = torch.Generator().manual_seed(6)
    rows, heads, n, d = 2, 3, 300, 40
    q, k, v = (torch.randn(rows, n, heads, d, generator=generator).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, 250:] = False
    strided = _pipeline(q, k, v, valid, clusters=10, topk=16)
    dense = _pipeline(q.contiguous(), k.contiguous(), v.contiguous(), valid, clusters=10, topk=16)
    for name, tensor in dense.items():
        assert torch.equal(strided[name], tensor), name


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_topk_ties_go_to_the_lowest_index_across_tiles(backend: str, device: str) -> None:
    """Exact score ties (duplicated integer keys) over several 256-key tiles: the reference's order."""
    require_kernels(backend)
    generator = torch.Generator().manual_seed(7)
    n, clusters, dk = 700, 3, 4
    distinct = torch.randint(-3, 4, (5, dk), generator=generator).float()
    keys = distinct[torch.randint(0, 5, (1, 1, n), generator=generator)]  # (1, 1, N, Dk): 5 distinct keys
    values = torch.randn(1, 1, n, 8, generator=generator)
    centroids = torch.randint(-2, 3, (1, 1, clusters, dk), generator=generator).float()
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, 100:120] = False
    expected = ref.centroid_attention(centroids, keys, values, valid, 40, 1.0)
    got = dispatch.BACKENDS[backend].centroid_attention(
        centroids.to(device), keys.to(device), values.to(device), valid.to(device), 40, 1.0
    )
    assert torch.equal(got[1].cpu(), expected[1])
    torch.testing.assert_close(got[2].cpu(), expected[2], atol=2e-6, rtol=0)


#: Head dims the kernels tile in 16s or 32s, around and off those sizes; Dv != Dk on some. Tolerance:
#: measured max abs error 3.3e-7 over these cases (CPU) -> 4e-6 (OP_ATOL of tests/ops/test_ops.py).
ODD_DIMS = [(1, 3), (8, 8), (40, 24), (72, 72), (200, 136)]


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("dk,dv", ODD_DIMS, ids=lambda d: str(d))
def test_odd_head_dims_and_dv_unlike_dk(dk: int, dv: int, backend: str, device: str) -> None:
    require_kernels(backend)
    q, k, v, valid = _qkv(2, 2, 150, dk, dv, seed=8)
    valid[0] = False  # one fully padded row
    config = ClusteredAttentionConfig(clusters=5, topk=20, bits=16)
    expected = clustered_attention(q, k, v, valid, config.replace(backend="reference"))
    got = clustered_attention(
        q.to(device), k.to(device), v.to(device), valid.to(device), config.replace(backend=backend)
    )
    torch.testing.assert_close(got.cpu(), expected, atol=4e-6, rtol=0)
    assert bool((got.cpu()[0] == 0).all())


@pytest.mark.parametrize(("backend", "device"), kernel_backends())
def test_more_than_k_ties_at_plus_inf_pick_k_keys_like_the_reference(backend, device) -> None:
    """An inf query makes its centroid score +inf against every key: 200 ties at +inf for k = 5.

    The CPU top-k took every key >= the bound just above +inf, which is +inf itself, and wrote 200
    candidates into a lane's buffer of k (heap corruption, found as an abort in the property suite).
    """
    require_kernels(backend)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 200, 8, generator=generator)
    k = torch.rand(1, 2, 200, 8, generator=generator) + 0.5  # positive keys: inf * k = +inf
    v = torch.randn(1, 2, 200, 8, generator=generator)
    q[0, 0, 10] = math.inf
    q, k, v = q.to(device), k.to(device), v.to(device)
    expected = clustered_attention(
        q, k, v, None, ClusteredAttentionConfig(clusters=4, topk=5, backend="reference")
    )
    got = clustered_attention(q, k, v, None, ClusteredAttentionConfig(clusters=4, topk=5, backend=backend))
    torch.testing.assert_close(
        got.cpu(), expected.cpu(), equal_nan=True, rtol=1e-5, atol=1e-5
    )  # measured 0.0


@pytest.mark.parametrize(("backend", "device"), kernel_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dk", [48, 64, 40])
def test_refinement_of_small_and_large_clusters_matches_the_reference(backend, device, dtype, dk) -> None:
    """Clusters of 1 to 12 queries and one of 180 in a head, plus padded queries.

    The CPU kernels score a small cluster's queries from its key rows and a large one's from its keys
    transposed (and any cluster's from the transposed keys when Dk is not a multiple of 16): every path
    against the reference, in topk_refine and i-clustered+'s refine_with_query_mass (on CUDA: one block
    per cluster, its members a warp each, whatever their count).
    """
    require_kernels(backend)
    generator = torch.Generator().manual_seed(8)
    n, clusters, topk = 280, 13, 32
    q, k, v = (torch.randn(1, 2, n, dk, generator=generator).to(dtype) for _ in range(3))
    sizes = [180, *range(1, 13)]  # 258 queries in clusters, the last 22 padded
    assign = torch.cat([torch.full((size,), c) for c, size in enumerate(sizes)] + [torch.full((22,), -1)])
    assignments = torch.stack([assign, assign[torch.randperm(n, generator=generator)]]).unsqueeze(0)
    valid = torch.ones(1, n, dtype=torch.bool)
    centroids, _ = ref.group_queries(q, assignments, clusters)
    scaling = 1 / math.sqrt(dk)
    attended = ref.centroid_attention(centroids, k, v, valid, topk, scaling)
    expected = ref.topk_refine(q, k, v, assignments, *attended, scaling)
    got = dispatch.BACKENDS[backend].topk_refine(
        q.to(device),
        k.to(device),
        v.to(device),
        assignments.to(device),
        *(t.to(device) for t in attended),
        scaling,
    )
    # measured max abs error 1.6e-7 (CPU, 2026-12-02); 4e-6 is OP_ATOL of tests/ops/test_ops.py
    torch.testing.assert_close(got.cpu(), expected, atol=4e-6, rtol=0)
    args = (q, k, v, valid, assignments, centroids, *attended, scaling)
    on = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args]
    # measured max abs error 3.3e-7 (CPU, 2026-12-02)
    torch.testing.assert_close(
        dispatch.BACKENDS[backend].refine_with_query_mass(*on).cpu(),
        ref.refine_with_query_mass(*args),
        atol=4e-6,
        rtol=0,
    )
