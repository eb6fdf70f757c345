"""The paper's properties and the project's rules, checked on the pure-PyTorch reference (CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bert_cluster import ClusteredAttentionConfig, clustered_attention
from bert_cluster import reference as R
from bert_cluster.attention import hash_planes

SCALE = 0.25


def qkv(rows=2, heads=3, n=48, dk=16, dv=8, dtype=torch.float32):
    return (
        torch.randn(rows, heads, n, dk, dtype=dtype),
        torch.randn(rows, heads, n, dk, dtype=dtype),
        torch.randn(rows, heads, n, dv, dtype=dtype),
    )


def config(**kw):
    return ClusteredAttentionConfig(backend="reference", **kw)


def exact(q, k, v, valid=None):
    if valid is None:
        valid = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool)
    return R.exact_attention(q, k, v, valid, SCALE)


# --- hashing and k-means rules -------------------------------------------------------------------


def test_hash_bits_are_signs_of_projections():
    q = torch.randn(1, 2, 10, 8)
    planes, offsets = hash_planes(3, 0, 5, 8)
    hashes = R.hash_queries(q, planes, offsets)
    projections = q @ planes.t() + offsets
    for b in range(5):
        assert torch.equal((hashes >> b) & 1, (projections[..., b] > 0).long())
    assert int(hashes.max()) < 2**5


def test_63_bit_hashes_fit_and_popcount_is_exact():
    x = torch.tensor([0, 1, 2**62 + 5, 2**63 - 1])
    assert R._popcount(x).tolist() == [0, 1, 3, 63]
    q = torch.randn(1, 1, 64, 32)
    hashes = R.hash_queries(q, *hash_planes(0, 0, 63, 32))
    assert int(hashes.min()) >= 0


def test_initial_centroids_are_distinct_and_spread():
    # 12 valid queries with hashes 0..5 each twice in order; C = 3 picks first occurrences 0, 2, 4.
    hashes = torch.tensor([[[0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]]])
    valid = torch.ones(1, 12, dtype=torch.bool)
    centroids, present = R._initial_centroids(hashes, valid, 3)
    assert centroids.tolist() == [[[0, 2, 4]]] and present.all()
    # Fewer distinct hashes than clusters: each taken once, the remaining clusters are empty.
    centroids, present = R._initial_centroids(
        torch.tensor([[[7, 7, 9, 7]]]), torch.ones(1, 4, dtype=torch.bool), 3
    )
    assert centroids[..., :2].tolist() == [[[7, 9]]] and present.tolist() == [[[True, True, False]]]


def test_kmeans_ties_go_to_lowest_cluster_and_padding_gets_minus_one():
    # 0b01 and 0b10 are at Hamming distance 1 from both centroids 0b00 and 0b11: the lowest index wins.
    hashes = torch.tensor([[[0b00, 0b11, 0b01, 0b10, 0b11]]])
    valid = torch.tensor([[True, True, True, True, False]])
    present = torch.ones(1, 1, 2, dtype=torch.bool)
    assignments = R._assign(hashes, valid, torch.tensor([[[0b00, 0b11]]]), present, bits=2)
    assert assignments.tolist() == [[[0, 1, 0, 0, -1]]]
    assignments = R._assign(hashes, valid, torch.tensor([[[0b11, 0b00]]]), present, bits=2)
    assert assignments.tolist() == [[[1, 0, 0, 0, -1]]]
    assignments, _ = R.hamming_kmeans(hashes, valid, clusters=2, iterations=2, bits=2)
    assert assignments[0, 0, 4] == -1 and (assignments[0, 0, :4] >= 0).all()


def test_kmeans_more_clusters_than_queries_leaves_empty_clusters_without_nan():
    q, k, v = qkv(rows=1, n=5)
    valid = torch.ones(1, 5, dtype=torch.bool)
    hashes = R.hash_queries(q, *hash_planes(0, 0, 8, 16))
    assignments, _ = R.hamming_kmeans(hashes, valid, clusters=9, iterations=3, bits=8)
    centroids, counts = R.group_queries(q, assignments, 9)
    assert torch.isfinite(centroids).all() and counts.sum(-1).eq(5).all()
    assert (counts == 0).any()  # 9 clusters, 5 queries


def test_majority_vote_keeps_the_old_bit_on_a_tie():
    hashes = torch.tensor([[[0b01, 0b10]]])  # one member votes bit0, the other bit1: both tied
    assignments = torch.tensor([[[0, 0]]])
    updated = R._majority_update(hashes, assignments, torch.tensor([[[0b11]]]), clusters=1, bits=2)
    assert updated.tolist() == [[[0b11]]]
    updated = R._majority_update(hashes, assignments, torch.tensor([[[0b00]]]), clusters=1, bits=2)
    assert updated.tolist() == [[[0b00]]]


# --- the paper's properties ---------------------------------------------------------------------


def test_topk_at_least_n_is_exact_attention():
    q, k, v = qkv(n=64)
    out = clustered_attention(q, k, v, None, config(clusters=5, topk=64), scaling=SCALE)
    assert (out - exact(q, k, v)).abs().max() < 1e-5


def test_topk_above_n_is_exact_attention_with_padding():
    q, k, v = qkv(n=64)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, 50:] = False
    out = clustered_attention(q, k, v, valid, config(clusters=5, topk=500), scaling=SCALE)
    diff = (out - exact(q, k, v, valid)) * valid[:, None, :, None]
    assert diff.abs().max() < 1e-5


def test_clustered_is_exact_when_queries_are_c_distinct_vectors():
    c, n = 4, 40
    distinct = torch.randn(1, 2, c, 16) * 3
    q = distinct[:, :, torch.arange(n) % c]
    _, k, v = qkv(rows=1, heads=2, n=n)
    out = clustered_attention(q, k, v, None, config(clusters=c, mode="clustered"), scaling=SCALE)
    assert (out - exact(q, k, v)).abs().max() < 1e-5
    # and the test can fail: with fewer clusters than distinct vectors it is not exact
    out = clustered_attention(q, k, v, None, config(clusters=c - 2, mode="clustered"), scaling=SCALE)
    assert (out - exact(q, k, v)).abs().max() > 1e-2


def attention_rows(q, k, v, valid, cfg):
    """The attention matrices (R, H, N, N) each method implies, recovered by feeding V = identity."""
    n = q.shape[2]
    eye = torch.eye(n).expand(q.shape[0], q.shape[1], n, n).contiguous()
    return clustered_attention(q, k, eye, valid, cfg, scaling=SCALE)


def test_rows_are_convex_combinations_of_values():
    q, k, _ = qkv(n=40)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[0, :5] = False
    for mode in ("i-clustered", "clustered"):
        weights = attention_rows(q, k, None, valid, config(clusters=4, topk=6, mode=mode))
        real = weights[0][:, 5:]  # valid queries of the padded row
        assert real.min() >= 0
        assert (real.sum(-1) - 1).abs().max() < 1e-5
        assert real[..., :5].abs().max() == 0  # padded keys get no weight


def test_proposition_2_per_row_l1():
    torch.manual_seed(1)
    q, k, _ = qkv(rows=1, heads=4, n=64)
    # Proposition 2 is about the paper's i-clustered against clustered on the same partition.
    full = attention_rows(q, k, None, None, config(clusters=8, topk=100, mode="i-clustered"))
    improved = attention_rows(q, k, None, None, config(clusters=8, topk=8, mode="i-clustered"))
    plain = attention_rows(q, k, None, None, config(clusters=8, mode="clustered"))
    err_i = (improved - full).abs().sum(-1)
    err_c = (plain - full).abs().sum(-1)
    assert (err_i <= err_c + 1e-5).all()
    assert err_i.mean() < err_c.mean()


# --- padding, short rows, seeds, dtypes ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["i-clustered", "clustered"])
def test_each_padded_row_equals_the_row_alone(mode):
    n = 61
    q, k, v = qkv(rows=3, n=n)
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[0, 45:] = False  # right padding, 45 valid
    valid[1, :14] = False  # left padding, 47 valid
    valid[2, [3, 17, 30]] = False  # holes anywhere, odd count
    cfg = config(clusters=6, topk=5, mode=mode)
    batched = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    for row in range(3):
        keep = valid[row].nonzero().squeeze(-1)
        alone = clustered_attention(
            q[row : row + 1, :, keep],
            k[row : row + 1, :, keep],
            v[row : row + 1, :, keep],
            None,
            cfg,
            scaling=SCALE,
        )
        assert (batched[row : row + 1, :, keep] - alone).abs().max() < 1e-5
        assert batched[row, :, ~valid[row]].abs().max() == 0  # padded queries: zeros (documented)


def test_short_rows_use_exact_attention_and_tiny_inputs_do_not_crash():
    q, k, v = qkv(rows=2, n=30)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, 10:] = False  # 10 valid <= C = 12: exact; row 0 (30 valid) is clustered
    out = clustered_attention(q, k, v, valid, config(clusters=12, topk=2), scaling=SCALE)
    ref = exact(q, k, v, valid)
    assert (out[1, :, :10] - ref[1, :, :10]).abs().max() < 1e-6
    assert (out[0] - ref[0]).abs().max() > 1e-3  # the long row really was approximated
    # min_length pushes longer rows to exact attention too
    out = clustered_attention(q, k, v, valid, config(clusters=12, topk=2, min_length=31), scaling=SCALE)
    assert (out - ref).abs().max() < 1e-6
    for n in (1, 2, 3):
        q1, k1, v1 = qkv(rows=1, n=n)
        out = clustered_attention(q1, k1, v1, None, config(clusters=25, topk=32), scaling=SCALE)
        assert out.shape == v1.shape and torch.isfinite(out).all()


def test_c_greater_than_n_and_k_greater_than_n_do_not_crash_in_the_steps():
    q, k, v = qkv(rows=1, n=6)
    valid = torch.ones(1, 6, dtype=torch.bool)
    hashes = R.hash_queries(q, *hash_planes(0, 0, 63, 16))
    assignments, _ = R.hamming_kmeans(hashes, valid, 10, 2, 63)
    centroids, _ = R.group_queries(q, assignments, 10)
    cv, idx, mass, tv = R.centroid_attention(centroids, k, v, valid, 50, SCALE)
    assert idx.shape[-1] == 6
    out = R.topk_refine(q, k, v, assignments, cv, idx, mass, tv, SCALE)
    assert (out - exact(q, k, v)).abs().max() < 1e-5  # k >= N: exact


def test_same_seed_same_output_other_seed_other_clusters():
    q, k, v = qkv(rows=1, heads=4, n=128)
    a = clustered_attention(q, k, v, None, config(clusters=8, topk=4, seed=7), scaling=SCALE)
    b = clustered_attention(q, k, v, None, config(clusters=8, topk=4, seed=7), scaling=SCALE)
    c = clustered_attention(q, k, v, None, config(clusters=8, topk=4, seed=8), scaling=SCALE)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    valid = torch.ones(1, 128, dtype=torch.bool)
    h7 = R.hash_queries(q, *hash_planes(7, 0, 63, 16))
    h8 = R.hash_queries(q, *hash_planes(8, 0, 63, 16))
    a7, _ = R.hamming_kmeans(h7, valid, 8, 10, 63)
    a8, _ = R.hamming_kmeans(h8, valid, 8, 10, 63)
    assert not torch.equal(a7, a8)


def test_each_layer_draws_its_own_planes():
    p0, o0 = hash_planes(0, 0, 16, 8)
    p1, _ = hash_planes(0, 1, 16, 8)
    p0_again, o0_again = hash_planes(0, 0, 16, 8)
    assert torch.equal(p0, p0_again) and torch.equal(o0, o0_again)
    assert not torch.equal(p0, p1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["i-clustered", "clustered"])
def test_half_precision_inputs_stay_finite_and_keep_their_dtype(dtype, mode):
    q, k, v = qkv(n=64, dtype=dtype)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[0, 40:] = False
    out = clustered_attention(q, k, v, valid, config(clusters=5, topk=8, mode=mode), scaling=SCALE)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref32 = clustered_attention(
        q.float(), k.float(), v.float(), valid, config(clusters=5, topk=8, mode=mode), scaling=SCALE
    )
    # fp32 internally: only the final rounding (and possible hash flips near 0) differ.
    tolerance = {torch.float16: 1e-4, torch.bfloat16: 1e-3}[dtype]  # measured mean: 2.1e-5 / 1.7e-4
    assert (out.float() - ref32).abs().mean() < tolerance


def test_bad_tensors_are_refused_with_a_message():
    q, k, v = qkv(n=8)
    with pytest.raises(ValueError, match="self-attention"):
        clustered_attention(q, k[:, :, :4], v, None, config())
    with pytest.raises(ValueError, match="valid must be a bool"):
        clustered_attention(q, k, v, torch.ones(2, 8), config())


@pytest.mark.parametrize("mode", ["i-clustered+", "clustered"])
def test_degenerate_shapes_give_an_empty_result_or_say_what_is_allowed(mode):
    # No rows (a (0, N) mask too), no heads and no tokens: an empty result, as torch's SDPA gives.
    for rows, heads, n in [(0, 2, 40), (2, 0, 40), (2, 2, 0)]:
        q, k, v = qkv(rows=rows, heads=heads, n=n)
        for valid in (None, torch.ones(rows, n, dtype=torch.bool)):
            out = clustered_attention(q, k, v, valid, config(mode=mode, clusters=4, topk=3))
            assert out.shape == (rows, heads, n, 8)
    # A head dim of 0 has no scaling 1/sqrt(Dk) and nothing to hash: refused, saying what is allowed.
    q, k, v = qkv(dk=0)
    for valid in (None, torch.ones(2, 48, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"head dim Dk must be at least 1, got query \(2, 3, 48, 0\)"):
            clustered_attention(q, k, v, valid, config(mode=mode))


# --- the proposition on real BERT queries --------------------------------------------------------


@pytest.mark.data
def test_improved_is_closer_to_exact_than_clustered_on_real_bert_queries(shared_dir, minilm_dir):
    from transformers import AutoModel, AutoTokenizer

    squad = json.loads((shared_dir / "data/squad/dev-v1.1.json").read_text())
    paragraphs = [p["context"] for article in squad["data"][:3] for p in article["paragraphs"][:2]]
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()
    batch = tokenizer(paragraphs, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    layer = model.encoder.layer[2].attention.self
    heads, dim = (
        model.config.num_attention_heads,
        model.config.hidden_size // model.config.num_attention_heads,
    )

    def split(x):
        return x.view(x.shape[0], x.shape[1], heads, dim).transpose(1, 2)

    with torch.inference_mode():
        q, k, v = (split(proj(hidden[2])) for proj in (layer.query, layer.key, layer.value))
    valid = batch["attention_mask"].bool()
    full = R.exact_attention(q, k, v, valid, 1 / math.sqrt(dim))
    mask = valid[:, None, :, None]
    errors = {"i-clustered": [], "clustered": []}
    for seed in range(3):
        for mode in errors:
            out = clustered_attention(q, k, v, valid, config(clusters=25, topk=32, mode=mode, seed=seed))
            errors[mode].append(((out - full) * mask).norm() / (full * mask).norm())
    mean_i = torch.stack(errors["i-clustered"]).mean()
    mean_c = torch.stack(errors["clustered"]).mean()
    assert mean_i < mean_c
    # measured (layer 2, 6 SQuAD paragraphs, 3 seeds): relative error i-clustered 0.218, clustered 0.633
    assert mean_i < 0.5 * mean_c


@pytest.mark.parametrize("window", [0, 1, 4, 64])
@pytest.mark.parametrize("n", [1, 7, 64, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_banded_attention_equals_sdpa_with_the_band_mask(n: int, window: int, dtype: torch.dtype) -> None:
    rows, heads = 3, 2
    q, k = torch.randn(rows, heads, n, 16).to(dtype), torch.randn(rows, heads, n, 16).to(dtype)
    v = torch.randn(rows, heads, n, 12).to(dtype)
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, : n // 3] = False  # left padding
    valid[2, n - n // 4 :] = False  # right padding
    out = R.banded_attention(q, k, v, valid, window, 0.25)
    positions = torch.arange(n)
    band = (positions[:, None] - positions[None, :]).abs() <= window
    mask = band[None, None] & valid[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.25
    )
    expected = expected * valid[:, None, :, None]
    # Both in fp32 from the same inputs: measured max difference 2.4e-7.
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)


def test_banded_attention_memory_is_linear_in_n() -> None:
    """The band is computed in blocks: no (N, N) score matrix (checked through the largest allocation)."""
    n, window = 4096, 8
    q = k = v = torch.randn(1, 1, n, 4)
    valid = torch.ones(1, n, dtype=torch.bool)
    with torch.profiler.profile(profile_memory=True) as prof:
        R.banded_attention(q, k, v, valid, window, 0.5)
    largest = max(event.cpu_memory_usage for event in prof.key_averages())
    assert largest < n * n * 4 // 16, f"largest allocation {largest} bytes suggests an (N, N) matrix"


# --- non-finite numbers and padding (issue 11, items 4 and 5) ---------------------------------------


def poisoned(tensor: torch.Tensor, valid: torch.Tensor, fill: float) -> torch.Tensor:
    """``tensor`` (R, H, N, D) with every padded position of ``valid`` set to ``fill``."""
    return torch.where(valid[:, None, :, None], tensor, torch.full_like(tensor, fill))


def padded_case(rows=3, n=40):
    q, k, v = qkv(rows=rows, n=n)
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[0, 30:] = False  # right
    valid[1, :9] = False  # left
    valid[2, [2, 11, 25]] = False  # holes
    return q, k, v, valid


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf, 1e30])
def test_each_step_ignores_whatever_padded_positions_hold(fill):
    """Measured before the fix: nan in a padded query made every valid output of its row nan
    (group_queries: 0 * nan), and nan in a padded value did the same through the centroid product."""
    q, k, v, valid = padded_case()
    pq, pk, pv = (poisoned(t, valid, fill) for t in (q, k, v))
    planes, offsets = hash_planes(0, 0, 63, 16)
    clean_hashes, bad_hashes = R.hash_queries(q, planes, offsets), R.hash_queries(pq, planes, offsets)
    assert torch.equal(
        clean_hashes[valid[:, None].expand_as(clean_hashes)], bad_hashes[valid[:, None].expand_as(bad_hashes)]
    )
    assignments, _ = R.hamming_kmeans(clean_hashes, valid, 5, 4, 63)
    assert torch.equal(assignments, R.hamming_kmeans(bad_hashes, valid, 5, 4, 63)[0])
    centroids, counts = R.group_queries(q, assignments, 5)
    assert torch.equal(centroids, R.group_queries(pq, assignments, 5)[0])
    clean = R.centroid_attention(centroids, k, v, valid, 6, SCALE)
    bad = R.centroid_attention(centroids, pk, pv, valid, 6, SCALE)
    for a, b in zip(clean, bad, strict=True):
        assert torch.equal(a, b)
    out = R.topk_refine(q, k, v, assignments, *clean, SCALE)
    assert torch.equal(out, R.topk_refine(pq, pk, pv, assignments, *clean, SCALE))
    assert torch.equal(R.broadcast_clusters(clean[0], assignments), R.broadcast_clusters(bad[0], assignments))
    assert torch.equal(R.exact_attention(q, k, v, valid, SCALE), R.exact_attention(pq, pk, pv, valid, SCALE))
    for window in (0, 3, 50):
        assert torch.equal(
            R.banded_attention(q, k, v, valid, window, SCALE),
            R.banded_attention(pq, pk, pv, valid, window, SCALE),
        )
    # End to end, both modes, clustered and short rows (C=12 puts row 2 above, min_length below).
    for cfg in (config(clusters=5, topk=6), config(clusters=5, mode="clustered"), config(min_length=100)):
        expected = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
        got = clustered_attention(pq, pk, pv, valid, cfg, scaling=SCALE)
        assert torch.equal(got, expected)
        assert torch.isfinite(got).all() and got[~valid[:, None, :].expand(-1, 3, -1)].abs().max() == 0


def nan_case(**change):
    """One row of 40 valid tokens (and a fully padded second row) with one poisoned entry."""
    q, k, v = qkv(rows=2, n=40)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1] = False
    for name, (position, value) in change.items():
        {"q": q, "k": k, "v": v}[name][0, 1, position, 0] = value
    return q, k, v, valid


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize(
    "cfg", [config(clusters=4, topk=6), config(clusters=4, mode="clustered"), config(min_length=41)], ids=str
)
def test_non_finite_valid_inputs_give_nan_where_they_reach_and_nowhere_else(bad, cfg):
    """Measured before the fix: the reference turned these into zeros (nan_to_num), the kernels into nan.

    Other heads and rows never see the bad number, and the fully padded row (no valid key) stays zeros.
    """

    def untouched_elsewhere(out):
        assert torch.isfinite(out[0, [0, 2]]).all() and out[1].abs().max() == 0

    # A nan key: every output of its (row, head) (every centroid, and every exact row, scores every key).
    # (An inf key is not checked here: its score is +inf or -inf by the sign of the query, and -inf is
    # just a zero weight, as in SDPA.)
    q, k, v, valid = nan_case(k=(7, math.nan))
    out = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    assert out[0, 1].isnan().all()
    untouched_elsewhere(out)
    # A value: its feature column, in every output of its (row, head) (nan, or inf for an inf value).
    q, k, v, valid = nan_case(v=(7, bad))
    out = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    assert (~torch.isfinite(out[0, 1, :, 0])).all() and torch.isfinite(out[0, 1, :, 1:]).all()
    untouched_elsewhere(out)
    # A query: its own output, and (clustered rows) its cluster's: the other clusters stay finite.
    q, k, v, valid = nan_case(q=(7, bad))
    out = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    assert out[0, 1, 7].isnan().all()
    assert torch.isfinite(out[0, 1]).all(-1).sum() >= 20
    untouched_elsewhere(out)
    # scaling: every valid output.
    q, k, v, valid = nan_case()
    out = clustered_attention(q, k, v, valid, cfg, scaling=bad)
    assert (~torch.isfinite(out[0])).all() and out[1].abs().max() == 0


def test_a_valid_key_scored_minus_inf_everywhere_is_nan_not_an_empty_row():
    """Zeros are for rows with no valid key (decided from the mask), never for all -inf scores."""
    q = torch.full((1, 1, 3, 2), -math.inf)
    k = torch.ones(1, 1, 3, 2)
    v = torch.randn(1, 1, 3, 2)
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert R.exact_attention(q, k, v, valid, 1.0).isnan().all()
    assert R.banded_attention(q, k, v, valid, 1, 1.0).isnan().all()
    assert R.exact_attention(q, k, v, torch.zeros_like(valid), 1.0).eq(0).all()


def test_banded_attention_nan_reaches_only_the_queries_whose_band_holds_it():
    n, window = 40, 2
    q, k, v = qkv(rows=1, heads=1, n=n)
    v[0, 0, 20, 1] = math.nan
    k[0, 0, 30, 0] = math.nan
    out = R.banded_attention(q, k, v, torch.ones(1, n, dtype=torch.bool), window, SCALE)
    broken = ~torch.isfinite(out[0, 0])
    sees_20 = (torch.arange(n) - 20).abs() <= window
    sees_30 = (torch.arange(n) - 30).abs() <= window
    assert broken[:, 1].eq(sees_20 | sees_30).all()  # value column 1: both
    assert broken[:, 0].eq(sees_30).all()  # other columns: only the nan key's neighbours


# --- head dims ------------------------------------------------------------------------------------


def test_query_and_key_of_different_head_dims_get_one_clear_error():
    q, _, v = qkv(n=30, dk=16)
    k = torch.randn(2, 3, 30, 12)
    message = "query and key must have the same head dim, got 16 and 12"
    valid = torch.ones(2, 30, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        clustered_attention(q, k, v, None, config())
    from bert_cluster.attention import windowed_attention

    with pytest.raises(ValueError, match=message):
        windowed_attention(q, k, v, None, 4, config())
    with pytest.raises(ValueError, match=message):
        R.exact_attention(q, k, v, valid, SCALE)
    with pytest.raises(ValueError, match=message):
        R.banded_attention(q, k, v, valid, 2, SCALE)
    with pytest.raises(ValueError, match=message):
        R.centroid_attention(q[:, :, :4], k, v, valid, 3, SCALE)


# --- short rows: SDPA over the valid keys only; routing once per mask --------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_short_rows_run_sdpa_over_their_valid_keys(dtype):
    from bert_cluster.attention import exact_rows

    q, k, v, valid = padded_case(rows=3, n=40)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    lengths = valid.sum(-1).tolist()
    out = exact_rows(q, k, v, valid, lengths, False, SCALE)
    assert out.dtype == dtype
    expected = R.exact_attention(q, k, v, valid, SCALE)
    # fp32: measured 3.0e-7; fp16/bf16: SDPA runs in the input dtype (measured 4.9e-4 / 3.9e-3).
    tolerance = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert (out.float() - expected).abs().max() < tolerance
    assert out[~valid[:, None, :].expand(-1, 3, -1)].abs().max() == 0
    # Right padding only: the slicing path gives what the gathering path gives.
    right = torch.arange(40)[None, :] < torch.tensor([[40], [31], [5]])
    a = exact_rows(q, k, v, right, right.sum(-1).tolist(), True, SCALE)
    b = exact_rows(q, k, v, right, right.sum(-1).tolist(), False, SCALE)
    assert torch.equal(a, b)


def test_short_rows_never_build_an_n_by_n_matrix():
    """Before: exact attention over the whole padded N, an (R, H, N, N) fp32 matrix (12.9 GB per row at
    N=16k, 12 heads). Now a short row costs its own valid length only."""
    n = 8192
    q = torch.randn(2, 1, n, 8)
    valid = torch.zeros(2, n, dtype=torch.bool)
    valid[0, :20] = True
    valid[1, 100:130] = True
    with torch.profiler.profile(profile_memory=True) as prof:
        out = clustered_attention(q, q, q, valid, config(clusters=40), scaling=SCALE)
    largest = max(event.cpu_memory_usage for event in prof.key_averages())
    assert largest < n * n * 4 // 64, f"largest allocation {largest} bytes"
    alone = R.exact_attention(
        q[1:, :, 100:130], q[1:, :, 100:130], q[1:, :, 100:130], valid[1:, 100:130], SCALE
    )
    assert (out[1, :, 100:130] - alone[0]).abs().max() < 2e-6


def test_routing_is_planned_once_per_mask_and_follows_in_place_edits(monkeypatch):
    from bert_cluster import attention

    calls = []
    original = attention._make_plan
    monkeypatch.setattr(attention, "_make_plan", lambda *a: calls.append(1) or original(*a))
    q, k, v, valid = padded_case(rows=3, n=40)
    cfg = config(clusters=12, topk=4)
    first = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    for _ in range(3):  # the layers of one forward pass: the same mask tensor
        assert torch.equal(clustered_attention(q, k, v, valid, cfg, scaling=SCALE), first)
    assert len(calls) == 1
    valid[0, :] = True  # edited in place: planned again, and the result follows
    again = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    assert len(calls) == 2 and not torch.equal(again[0], first[0])
    fresh = valid.clone()  # another tensor: planned again
    clustered_attention(q, k, v, fresh, cfg, scaling=SCALE)
    assert len(calls) == 3


def test_hash_planes_are_cached_per_device():
    a = hash_planes(3, 2, 63, 16, "cpu")
    b = hash_planes(3, 2, 63, 16, torch.device("cpu"))
    assert a[0] is b[0] and a[1] is b[1]


# --- length scaling ---------------------------------------------------------------------------------


def test_rows_of_different_lengths_use_their_own_cluster_counts():
    """A batch of rows of different lengths: each row gives what it gives alone (its own C and k)."""
    n = 1200
    q, k, v = qkv(rows=3, heads=2, n=n, dk=8, dv=8)
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[1, 600:] = False  # 600 tokens: C and k grown
    valid[2, 300:] = False  # 300 tokens: unscaled
    cfg = config(clusters=8, topk=4, iterations=3)
    assert len({cfg.row_settings(int(length)) for length in valid.sum(-1)}) == 3
    batched = clustered_attention(q, k, v, valid, cfg, scaling=SCALE)
    for row in range(3):
        keep = valid[row]
        alone = clustered_attention(
            q[row : row + 1, :, keep],
            k[row : row + 1, :, keep],
            v[row : row + 1, :, keep],
            None,
            cfg,
            scaling=SCALE,
        )
        assert (batched[row : row + 1, :, keep] - alone).abs().max() < 1e-5
    fixed = clustered_attention(q, k, v, valid, cfg.replace(cluster_growth=0, topk_growth=0), scaling=SCALE)
    assert torch.equal(fixed[2], batched[2]) and not torch.equal(fixed[0], batched[0])
