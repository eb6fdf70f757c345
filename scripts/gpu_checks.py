"""The GPU checks the CPU test suite cannot make, run by scripts/gpu_check.sh on a machine with a CUDA GPU.

From the repository root, with the checkout's package importable (gpu_check.sh puts the root on PYTHONPATH):

    python scripts/gpu_checks.py checks --output OUT/checks.json   # correctness on the GPU (~1 min)
    python scripts/gpu_checks.py quick                              # small shapes, for compute-sanitizer
    python scripts/gpu_checks.py bench --output OUT/bench.json      # CUDA-event timings, SDPA, peak memory
    python scripts/gpu_checks.py pytest --output OUT/pytest.json -- -m cuda tests/ops   # fails on skips

``--device cpu`` (gpu_check.sh --dry-run) runs the same code with the CPU kernels standing in for CUDA, on
smaller shapes: the checks that only a GPU can make (a side stream, host syncs, device assertions) are
recorded as ``stub``. Every timing and determinism figure is taken on the mode the kernels serve alone
(``mode="i-clustered"``, no growth of C and k with length); convert's default (i-clustered+, which grows
C and k and runs PyTorch steps between the kernels) is timed separately and labelled so.

`checks`: every op against the reference on the GPU at N = 5,000 and 8,192; head dims 8, 40, 72, 200, 256,
512 and Dv != Dk; a fully padded row; C above the valid count with duplicate hashes; N = 1; many rows and
heads; HF-layout (non-contiguous) inputs; a side stream; no host synchronisation inside the ops
(torch.cuda.set_sync_debug_mode); run-to-run determinism; out-of-range indices failing a device assertion.
Each check is recorded as passed / failed with its error and measured figures; one failure does not stop
the others. `bench`: per-op CUDA-event timings, i-clustered end to end against SDPA (flash, bf16) at 4k to
32k tokens, batch 1 and 16, and the peak memory of a mixed batch at 16k.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bert_cluster import ClusteredAttentionConfig, clustered_attention, dispatch
from bert_cluster import reference as ref
from bert_cluster.attention import hash_planes, windowed_attention

ROOT = Path(__file__).resolve().parent.parent

DEVICE = "cuda"  # "cpu" with --device cpu: the CPU kernels stand in (gpu_check.sh --dry-run)
BACKEND = "cuda"
#: Shapes are divided by this on the CPU stand-in (it checks the scripts' code, not the GPU's numbers).
SHRINK = 1
#: What a check of the GPU alone records on the stand-in.
STUB = "stub"
#: The (R, H, N, k, D) fp32 gather that i-clustered+'s PyTorch refinement makes is skipped above this.
GATHER_LIMIT_BYTES = 32 * 2**30
#: Float outputs of one op against the reference on the same inputs (fp32 accumulation on both sides):
#: the CPU suite's thresholds (tests/ops/test_ops.py OP_ATOL), doubled for the longer rows here.
OP_ATOL = {torch.float32: 8e-6, torch.float16: 8e-6, torch.bfloat16: 1.2e-5}
END_ATOL = {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(rows, heads, n, dk, dv=None, dtype=torch.float32, seed=0, pad=True):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, n, dk, generator=generator).to(dtype)
    k = torch.randn(rows, heads, n, dk, generator=generator).to(dtype)
    v = torch.randn(rows, heads, n, dv or dk, generator=generator).to(dtype)
    valid = torch.ones(rows, n, dtype=torch.bool)
    if pad and rows > 1:
        valid[-1, n - n // 3 :] = False
        valid[-1, n // 5] = False
    return q, k, v, valid


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max()) if a.numel() else 0.0


def kernel_config(**changes) -> ClusteredAttentionConfig:
    """The kernels' own mode: i-clustered, C and k fixed at every length, on the backend under test."""
    settings = dict(mode="i-clustered", cluster_growth=0, topk_growth=0, min_length=0, backend=BACKEND)
    settings.update(changes)
    return ClusteredAttentionConfig(**settings)


class Checks:
    """Runs named checks, recording each outcome; never lets one failure stop the rest."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def run(self, name: str, fn) -> None:
        start = time.perf_counter()
        entry: dict = {"check": name}
        try:
            facts = fn() or {}
            entry.update(status=facts.pop("status", "passed"), **facts)
        except Exception as error:  # noqa: BLE001 - recorded, then the next check runs
            trace = traceback.format_exc()[-2000:]
            entry.update(status="failed", error=f"{type(error).__name__}: {error}", trace=trace)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        self.results.append(entry)
        print(
            f"[{entry['status']:7s}] {name} ({entry['seconds']} s)"
            + (f": {entry.get('error', '')}" if entry["status"] == "failed" else ""),
            flush=True,
        )


def ops_against_reference(
    n: int,
    dtype,
    dk: int = 64,
    dv: int | None = None,
    rows: int = 2,
    heads: int = 2,
    clusters: int = 25,
    topk: int = 32,
    given=None,
) -> dict:
    """Every op on the GPU against the reference (run on the CPU) on the reference's own inputs."""
    cuda = dispatch.BACKENDS[BACKEND]
    q, k, v, valid = given if given is not None else _inputs(rows, heads, n, dk, dv, dtype)
    planes, offsets = hash_planes(0, 0, 63, dk)
    scaling = 1 / math.sqrt(dk)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    errors = {}
    hashes = ref.hash_queries(q, planes, offsets)
    got_hashes = cuda.hash_queries(d(q), d(planes), d(offsets)).cpu()
    errors["hash_bits_differing_fraction"] = float((got_hashes != hashes).float().mean())
    assign, cent = ref.hamming_kmeans(hashes, valid, clusters, 10, 63)
    got_assign, got_cent = cuda.hamming_kmeans(d(hashes), d(valid), clusters, 10, 63)
    assert torch.equal(got_assign.cpu(), assign), "hamming_kmeans assignments differ"
    assert torch.equal(got_cent.cpu(), cent), "hamming_kmeans centroids differ"
    centroids, counts = ref.group_queries(q, assign, clusters)
    got_centroids, got_counts = cuda.group_queries(d(q), d(assign), clusters)
    assert torch.equal(got_counts.cpu(), counts), "group_queries counts differ"
    errors["group_queries"] = _max_err(got_centroids, centroids)
    expected = ref.centroid_attention(centroids, k, v, valid, topk, scaling)
    got = cuda.centroid_attention(d(centroids), d(k), d(v), d(valid), topk, scaling)
    errors["centroid_values"] = _max_err(got[0], expected[0])
    errors["topk_indices_differing"] = int((got[1].cpu() != expected[1]).sum())
    errors["topk_mass"] = _max_err(got[2], expected[2])
    errors["topk_values"] = _max_err(got[3], expected[3])
    refined = ref.topk_refine(q, k, v, assign, *expected, scaling)
    got_refined = cuda.topk_refine(d(q), d(k), d(v), d(assign), *[d(t) for t in expected], scaling)
    errors["topk_refine"] = _max_err(got_refined, refined)
    broadcast = ref.broadcast_clusters(expected[0], assign)
    errors["broadcast_clusters"] = _max_err(cuda.broadcast_clusters(d(expected[0]), d(assign)), broadcast)
    band = ref.banded_attention(q, k, v, valid, 64, scaling)
    errors["banded_attention"] = _max_err(
        cuda.banded_attention(d(q), d(k), d(v), d(valid), 64, scaling), band
    )
    # i-clustered+ (kernels/cuda/plus.cu): Lloyd rounds from the Hamming partition, then the refinement with
    # each query's own mass on the reference's own inputs. Lloyd's distances sum in another order than the
    # reference's GEMM: a query within ulps of a tie may go the other way; the means of one partition are
    # the same sums in the same order (bit for bit).
    plus = ref.lloyd_refine(q, assign, clusters, 2)
    got_plus = [t.cpu() for t in cuda.lloyd_refine(d(q), d(assign), clusters, 2)]
    errors["lloyd_assignments_differing"] = int((got_plus[0] != plus[0]).sum())
    if errors["lloyd_assignments_differing"] == 0:
        assert torch.equal(got_plus[1], plus[1]), "lloyd_refine means differ on the same partition"
        assert torch.equal(got_plus[2], plus[2]), "lloyd_refine counts differ"
    plus_attended = ref.centroid_attention(plus[1], k, v, valid, topk, scaling)
    plus_args = (q, k, v, valid, plus[0], plus[1], *plus_attended, scaling)
    errors["refine_with_query_mass"] = _max_err(
        cuda.refine_with_query_mass(*[d(t) if isinstance(t, torch.Tensor) else t for t in plus_args]),
        ref.refine_with_query_mass(*plus_args),
    )
    atol = OP_ATOL[dtype]
    floats = (
        "group_queries",
        "centroid_values",
        "topk_mass",
        "topk_values",
        "topk_refine",
        "banded_attention",
        "refine_with_query_mass",
    )
    for name in floats:
        assert errors[name] <= atol, f"{name}: max abs error {errors[name]:.3g} > {atol}"
    assert errors["broadcast_clusters"] == 0.0
    # A different GEMM order may flip a hash bit within ulps of 0 or swap two near-equal top-k scores.
    assert errors["hash_bits_differing_fraction"] < 1e-3, errors
    assert errors["topk_indices_differing"] <= 0.001 * got[1].numel() + 2, errors
    assert errors["lloyd_assignments_differing"] <= 0.001 * plus[0].numel() + 2, errors
    return {"errors": errors}


def end_to_end(
    n,
    dk,
    dv=None,
    dtype=torch.float32,
    rows=2,
    heads=2,
    clusters=25,
    topk=32,
    mode="i-clustered",
    valid=None,
    seed=0,
    q=None,
    k=None,
    v=None,
) -> dict:
    if q is None:
        q, k, v, made = _inputs(rows, heads, n, dk, dv, dtype, seed)
        valid = made if valid is None else valid
    config = kernel_config(clusters=clusters, topk=topk, mode=mode)
    expected = clustered_attention(
        q.float().contiguous(),
        k.float().contiguous(),
        v.float().contiguous(),
        valid,
        config.replace(backend="reference"),
    )
    got = clustered_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), valid.to(DEVICE), config.replace(backend=BACKEND)
    )
    err = _max_err(got, expected)
    assert err <= END_ATOL[dtype], f"max abs error {err:.3g}"
    band_expected = ref.banded_attention(
        q.float(), k.float(), v.float(), valid, 16, 1 / math.sqrt(q.shape[-1])
    )
    band = windowed_attention(
        q.to(DEVICE).float(),
        k.to(DEVICE).float(),
        v.to(DEVICE).float(),
        valid.to(DEVICE),
        16,
        config.replace(backend=BACKEND),
    )
    band_err = _max_err(band, band_expected)
    assert band_err <= OP_ATOL[torch.float32], f"band max abs error {band_err:.3g}"
    return {"max_abs_error": err, "band_max_abs_error": band_err}


def run_to_run_determinism() -> dict:
    """The same bits twice, end to end and op by op, on the kernels' own modes (no growth): i-clustered,
    and i-clustered+ (whose Lloyd rounds and refinement are kernels too since issue 38: no PyTorch
    ``index_add_``, which is non-deterministic on CUDA, in between).
    """
    n = 3000 // SHRINK
    q, k, v, valid = (t.to(DEVICE) for t in _inputs(2, 4, n, 64, dtype=torch.bfloat16, seed=3))
    config = kernel_config()
    base = clustered_attention(q, k, v, valid, config)
    again = clustered_attention(q, k, v, valid, config)
    assert torch.equal(base, again), "clustered_attention (i-clustered) differs between two runs"
    plus = config.replace(mode="i-clustered+")
    plus_first = clustered_attention(q, k, v, valid, plus)
    plus_again = clustered_attention(q, k, v, valid, plus)
    assert torch.equal(plus_first, plus_again), "clustered_attention (i-clustered+) differs between two runs"
    band = windowed_attention(q, k, v, valid, 64, config)
    assert torch.equal(band, windowed_attention(q, k, v, valid, 64, config)), "banded differs between runs"
    return {"modes": [config.mode, plus.mode], "n": n}


def backward_against_reference(n: int, dtype: torch.dtype) -> dict:
    """The backward ops (issue 38) against autograd through the reference, and the same bits twice (every
    backward op, i-clustered+'s refinement and the band's included).

    Tolerance relative to the largest gradient entry, as tests/ops/test_backward.py (GRAD_RTOL), doubled.
    """
    from bert_cluster import ops

    rtol = 8e-6 if dtype == torch.float32 else 1.6e-2
    q, k, v, valid = (t.to(DEVICE) for t in _inputs(2, 4, n, 64, dtype=dtype, seed=5))
    planes, offsets = hash_planes(0, 0, 63, 64, DEVICE)
    assign, _ = ref.hamming_kmeans(ref.hash_queries(q, planes, offsets), valid, 25, 10, 63)
    centroids, _ = ref.group_queries(q, assign, 25)
    vc, indices, mass, topv = ref.centroid_attention(centroids, k, v, valid, 32, 0.125)
    generator = torch.Generator(device=DEVICE).manual_seed(6)
    grad = torch.randn(*q.shape, generator=generator, device=DEVICE)
    g_vc, g_mass, g_topv = (
        torch.randn(t.shape, generator=generator, device=DEVICE) for t in (vc, mass, topv)
    )
    calls = {
        "topk_refine_backward": (grad, q, k, v, assign, indices, mass, 0.125),
        "centroid_attention_backward": (g_vc, g_mass, g_topv, centroids, k, v, valid, indices, 0.125),
        "group_queries_backward": (
            torch.randn(centroids.shape, generator=generator, device=DEVICE),
            q,
            assign,
        ),
        "broadcast_clusters_backward": (grad, vc, assign),
        "banded_attention_backward": (grad, q, k, v, valid, 64, 0.125),
    }
    # i-clustered+'s refinement (float32 inputs: ops.py widens the half dtypes before the backward op).
    plus_assign, plus_centroids, _ = ref.lloyd_refine(q, assign, 25, 2)
    plus_attended = ref.centroid_attention(plus_centroids, k, v, valid, 32, 0.125)
    calls["refine_with_query_mass_backward"] = (
        grad,
        q.float(),
        k.float(),
        v.float(),
        valid,
        plus_assign,
        plus_centroids,
        *plus_attended,
        0.125,
    )
    errors = {}
    for name, args in calls.items():
        got, again = getattr(ops, name)(*args), getattr(ops, name)(*args)
        expected = getattr(ref, name)(*args)
        got, again, expected = (x if isinstance(x, tuple) else (x,) for x in (got, again, expected))
        worst = 0.0
        for a, b, e in zip(got, again, expected, strict=True):
            assert torch.equal(a, b), f"{name} differs between two runs"
            scale = max(e.float().abs().max().item(), 1e-6)
            worst = max(worst, (a.float() - e.float()).abs().max().item() / scale)
        assert worst <= rtol, f"{name}: relative error {worst:.3g} > {rtol}"
        errors[name] = worst
    return {"relative_error": errors}


def side_stream_no_sync() -> dict:
    """Every op on a side stream with torch raising on any host synchronisation inside the ops."""
    if DEVICE != "cuda":
        return {"status": STUB, "why": "needs a GPU (CUDA streams, torch.cuda.set_sync_debug_mode)"}
    from bert_cluster import ops

    q, k, v, valid = (t.to(DEVICE) for t in _inputs(2, 4, 3000, 64, dtype=torch.bfloat16, seed=3))
    clustered_attention(q, k, v, valid, kernel_config())  # warm-up (planes cached, kernels loaded)
    planes, offsets = hash_planes(0, 0, 63, 64, DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            hashes = ops.hash_queries(q, planes, offsets)
            assign, _ = ops.hamming_kmeans(hashes, valid, 25, 10, 63)
            centroids, _ = ops.group_queries(q, assign, 25)
            attended = ops.centroid_attention(centroids, k, v, valid, 32, 0.125)
            first = ops.topk_refine(q, k, v, assign, *attended, 0.125)
            again = ops.centroid_attention(centroids, k, v, valid, 32, 0.125)
            second = ops.topk_refine(q, k, v, assign, *again, 0.125)
            band = ops.banded_attention(q, k, v, valid, 64, 0.125)
            band_again = ops.banded_attention(q, k, v, valid, 64, 0.125)
            # The backward ops (issue 38), with the forward's outputs standing in for gradients.
            vc, indices, mass, topv = attended
            backward = [
                ops.topk_refine_backward(first, q, k, v, assign, indices, mass, 0.125),
                ops.centroid_attention_backward(vc, mass, topv, centroids, k, v, valid, indices, 0.125),
                (ops.group_queries_backward(centroids, q, assign),),
                (ops.broadcast_clusters_backward(first, vc, assign),),
                ops.banded_attention_backward(band, q, k, v, valid, 64, 0.125),
            ]
            # i-clustered+ (kernels/cuda/plus.cu): Lloyd rounds, the refinement and its backward.
            plus_assign, plus_centroids, _ = ops.lloyd_refine(q, assign, 25, 2)
            plus_attended = ops.centroid_attention(plus_centroids, k, v, valid, 32, 0.125)
            plus_args = (q, k, v, valid, plus_assign, plus_centroids, *plus_attended, 0.125)
            plus_out = ops.refine_with_query_mass(*plus_args)
            plus_again = ops.refine_with_query_mass(*plus_args)
            wide = [t.float() if t.is_floating_point() else t for t in plus_args[:-1]]
            backward.append(ops.refine_with_query_mass_backward(plus_out, *wide, 0.125))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    assert torch.equal(first, second), "topk_refine differs between two runs"
    assert torch.equal(band, band_again), "banded_attention differs between two runs"
    assert torch.equal(plus_out, plus_again), "refine_with_query_mass differs between two runs"
    assert all(torch.isfinite(t).all() for group in backward for t in group), (
        "a backward op gave non-finite values"
    )
    return {"sync_debug_mode": "error (no synchronising call inside the ops)"}


def device_assert_on_bad_assignments() -> dict:
    """Out-of-range assignments fail a device-side assertion (in a child: the CUDA context is lost after)."""
    if DEVICE != "cuda":
        return {"status": STUB, "why": "needs a GPU (a device-side assertion)"}
    code = (
        "import torch; from bert_cluster import ops\n"
        "q = torch.randn(1, 1, 16, 8, device='cuda')\n"
        "a = torch.zeros(1, 1, 16, dtype=torch.long, device='cuda')\n"
        "a[0, 0, 3] = 7\n"
        "ops.group_queries(q, a, 3); torch.cuda.synchronize(); print('NO ERROR')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NO ERROR" not in text, "an out-of-range assignment was accepted"
    assert "assert" in text.lower(), text[-500:]
    return {"message": text.strip().splitlines()[-1][:200]}


#: The most clusters the CUDA hamming_kmeans admits (kernels/cuda/hash.cu: 48 KiB of shared memory).
KMEANS_MAX_CLUSTERS = 4010


def kmeans_many_clusters(clusters: int, n: int, iterations: int = 3) -> dict:
    """hamming_kmeans against the reference where C is large: from C = 177 the CUDA kernel keeps its
    counts in global memory (they no longer fit in shared memory beside the centroids), and C = 4010, the
    largest its check admits, must launch. Distinct hashes outnumber C, so every centroid is used."""
    generator = torch.Generator().manual_seed(clusters)
    hashes = torch.randint(0, 2**40, (1, 2, n), generator=generator)
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, n - n // 7 :] = False
    expected = ref.hamming_kmeans(hashes, valid, clusters, iterations, 40)
    got = dispatch.BACKENDS[BACKEND].hamming_kmeans(
        hashes.to(DEVICE), valid.to(DEVICE), clusters, iterations, 40
    )
    assert torch.equal(got[0].cpu(), expected[0]), f"assignments differ at C = {clusters}"
    assert torch.equal(got[1].cpu(), expected[1]), f"centroids differ at C = {clusters}"
    facts = {"clusters": clusters, "n": n, "iterations": iterations}
    if BACKEND == "cuda" and clusters == KMEANS_MAX_CLUSTERS:
        try:
            dispatch.BACKENDS[BACKEND].hamming_kmeans(
                hashes.to(DEVICE), valid.to(DEVICE), clusters + 1, 1, 40
            )
        except (ValueError, RuntimeError) as error:
            facts["refused_above"] = str(error).splitlines()[0][:200]
        else:
            raise AssertionError(f"C = {clusters + 1} was admitted; the kernel's limit says {clusters}")
    return facts


def checks(output: Path) -> int:
    torch.manual_seed(0)
    ok, why = dispatch.BACKENDS[BACKEND].is_available()
    if not ok:
        output.write_text(json.dumps({"error": f"{BACKEND} backend unavailable: {why}"}, indent=1))
        print(f"{BACKEND} backend unavailable: {why}")
        return 1
    c = Checks()
    for n in (5000, 8192):
        for dtype in (torch.float32, torch.bfloat16):
            c.run(
                f"ops vs reference N={n // SHRINK} {dtype}",
                lambda n=n, dtype=dtype: ops_against_reference(n // SHRINK, dtype),
            )
    for dk in (8, 40, 72, 200, 256, 512):
        c.run(f"end to end head dim {dk}", lambda dk=dk: end_to_end(300, dk, heads=2))
    c.run("Dv != Dk (64, 40)", lambda: end_to_end(400, 64, 40))

    def head_dim_limit():
        if DEVICE != "cuda":
            return {"status": STUB, "why": "the CUDA backend's own limit"}
        reasons = dispatch.CudaKernelBackend.not_supported_reasons(torch.zeros(1, 1, 2, 513, device=DEVICE))
        assert reasons, "no reason given for Dk=513"
        assert dispatch.select_backend("auto", torch.zeros(1, 1, 2, 513, device=DEVICE)).name == "reference"
        return {"reasons": reasons}

    c.run("head dim 513 declines CUDA with a reason (auto falls back)", head_dim_limit)

    def fully_padded():
        q, k, v, valid = _inputs(3, 2, 200, 64)
        valid[1] = False
        facts = end_to_end(200, 64, q=q, k=k, v=v, valid=valid)
        got = clustered_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), valid.to(DEVICE), kernel_config())
        assert bool((got[1] == 0).all()), "a fully padded row must give zeros"
        return facts

    c.run("fully padded row", fully_padded)

    def duplicate_hashes():
        q, k, v, valid = _inputs(2, 2, 300, 32, seed=5)
        q = q[:, :, torch.arange(300) % 7].contiguous()  # 7 distinct queries: 7 distinct hashes at most
        valid[1, 40:] = False  # row 1: 40 valid tokens, fewer than C = 50
        facts = ops_against_reference(300, torch.float32, dk=32, clusters=50, given=(q, k, v, valid))
        facts["end_to_end"] = end_to_end(300, 32, q=q, k=k, v=v, valid=valid, clusters=50)
        return facts

    c.run("C above the valid count, duplicate hashes", duplicate_hashes)
    c.run("N = 1", lambda: end_to_end(1, 64, rows=3))
    # Op by op (each op fed the reference's own inputs): a hash bit that another summation order flips
    # near a zero projection (~0.2% of orders here) then changes one hash, not the whole output.
    rows = 32 // SHRINK
    many = lambda: ops_against_reference(256, torch.float16, dk=32, rows=rows, heads=16)  # noqa: E731
    c.run(f"many rows and heads ({rows} x 16 x 256), op by op", many)
    c.run(
        "hamming_kmeans C = 200 (counts in global memory)", lambda: kmeans_many_clusters(200, 6000 // SHRINK)
    )
    c.run(
        f"hamming_kmeans C = {KMEANS_MAX_CLUSTERS} (the largest admitted) launches",
        lambda: kmeans_many_clusters(KMEANS_MAX_CLUSTERS, 6000 if DEVICE == "cuda" else 4400, iterations=1),
    )

    def hf_layout():
        generator = torch.Generator().manual_seed(6)
        q, k, v = (torch.randn(2, 500, 12, 64, generator=generator).transpose(1, 2) for _ in range(3))
        valid = torch.ones(2, 500, dtype=torch.bool)
        valid[1, 420:] = False
        return end_to_end(500, 64, q=q, k=k, v=v, valid=valid)

    c.run("HF-layout non-contiguous inputs", hf_layout)
    c.run("run-to-run determinism (i-clustered, no growth)", run_to_run_determinism)
    c.run("side stream, no host sync", side_stream_no_sync)
    for dtype in (torch.float32, torch.bfloat16):
        c.run(
            f"backward ops vs reference {dtype}", lambda dtype=dtype: backward_against_reference(700, dtype)
        )
    c.run("out-of-range assignments fail a device assertion", device_assert_on_bad_assignments)
    failed = [r["check"] for r in c.results if r["status"] not in ("passed", STUB)]
    stubs = [r["check"] for r in c.results if r["status"] == STUB]
    output.write_text(
        json.dumps({"device": DEVICE, "failed": failed, "stubs": stubs, "results": c.results}, indent=1)
    )
    passed = len(c.results) - len(failed) - len(stubs)
    print(f"{passed} of {len(c.results)} checks passed, {len(stubs)} stubs (GPU only); wrote {output}")
    return 1 if failed else 0


def quick() -> int:
    """Small shapes through every op (for compute-sanitizer memcheck / racecheck)."""
    for n, dk, dv, rows in ((1, 8, 8, 1), (37, 40, 24, 2), (300, 64, 64, 2)):
        q, k, v, valid = (t.to(DEVICE) for t in _inputs(rows, 2, n, dk, dv, seed=n))
        for mode in ("i-clustered", "clustered"):
            clustered_attention(q, k, v, valid, kernel_config(clusters=5, topk=8, mode=mode))
        windowed_attention(q, k, v, valid, 7, kernel_config())
        # The backward kernels (issue 38), i-clustered+'s kernels and the band's backward among them.
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        for mode in ("i-clustered+", "i-clustered"):
            config = kernel_config(clusters=5, topk=8, mode=mode)
            clustered_attention(*leaves, valid, config).sum().backward()
        windowed_attention(*leaves, valid, 7, kernel_config()).sum().backward()
    hashes = torch.randint(0, 2**40, (1, 1, 400), device=DEVICE)
    dispatch.BACKENDS[BACKEND].hamming_kmeans(
        hashes, torch.ones(1, 400, dtype=torch.bool, device=DEVICE), 200, 2, 40
    )
    _sync()
    print("quick: done")
    return 0


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _event_time(fn, repeats: int) -> float:
    """Median milliseconds of fn over `repeats` runs (CUDA events; a wall clock on the stand-in)."""
    fn()
    times = []
    for _ in range(repeats):
        if DEVICE != "cuda":
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _bf16_inputs(batch: int, n: int, heads: int, dim: int):
    generator = torch.Generator(device=DEVICE).manual_seed(n)
    return tuple(
        torch.randn(batch, heads, n, dim, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        for _ in range(3)
    )


def bench_case(batch: int, n: int, repeats: int, heads: int = 12, dim: int = 64) -> dict:
    """One (batch, N): SDPA (flash, bf16), i-clustered (C 25, k 32 at every length) end to end, each op."""
    from bert_cluster import ops

    q, k, v = _bf16_inputs(batch, n, heads, dim)
    valid = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    config = kernel_config()
    if DEVICE == "cuda":
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            sdpa = _event_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), repeats)
    else:
        sdpa = _event_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), repeats)
    total = _event_time(lambda: clustered_attention(q, k, v, valid, config), repeats)
    planes, offsets = hash_planes(0, 0, 63, dim, DEVICE)
    hashes = ops.hash_queries(q, planes, offsets)
    assign, _ = ops.hamming_kmeans(hashes, valid, 25, 10, 63)
    centroids, _ = ops.group_queries(q, assign, 25)
    attended = ops.centroid_attention(centroids, k, v, valid, 32, 0.125)
    steps = {
        "hash_queries": lambda: ops.hash_queries(q, planes, offsets),
        "hamming_kmeans": lambda: ops.hamming_kmeans(hashes, valid, 25, 10, 63),
        "group_queries": lambda: ops.group_queries(q, assign, 25),
        "centroid_attention": lambda: ops.centroid_attention(centroids, k, v, valid, 32, 0.125),
        "topk_refine": lambda: ops.topk_refine(q, k, v, assign, *attended, 0.125),
        "banded_attention (w=64)": lambda: ops.banded_attention(q, k, v, valid, 64, 0.125),
    }
    per_op = {name: _event_time(step, repeats) for name, step in steps.items()}
    return {
        "batch": batch,
        "n": n,
        "mode": "i-clustered (C 25, k 32, no growth)",
        "sdpa_flash_bf16_ms": sdpa,
        "i_clustered_ms": total,
        "speedup_vs_sdpa": sdpa / total,
        "ops_ms": per_op,
    }


def plus_case(batch: int, n: int, repeats: int, heads: int = 12, dim: int = 64) -> dict:
    """convert's default (i-clustered+ with growth), timed apart: C and k grow with the length, and its
    Lloyd refinement runs PyTorch steps, one of which gathers an (R, H, N, k, D) fp32 tensor."""
    config = ClusteredAttentionConfig(backend=BACKEND, min_length=0)
    clusters, topk = config.row_settings(n)
    gather = batch * heads * n * topk * dim * 4
    row = {
        "batch": batch,
        "n": n,
        "mode": f"i-clustered+ (convert default: C {clusters}, k {topk} at this N)",
    }
    row["gather_gb"] = round(gather / 1e9, 1)
    if gather > GATHER_LIMIT_BYTES:
        row["skipped"] = f"the (R, H, N, k, D) gather would take {gather / 1e9:.1f} GB"
        return row
    q, k, v = _bf16_inputs(batch, n, heads, dim)
    valid = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    timed = lambda: clustered_attention(q, k, v, valid, config)  # noqa: E731
    row["i_clustered_plus_ms"] = _event_time(timed, min(repeats, 2))
    return row


def bench(output: Path, lengths: list[int], batches: list[int], repeats: int, plus: list[int]) -> int:
    """Every row is written out as soon as it is measured: a stage cut short keeps what it measured."""
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else f"{DEVICE} (stand-in)",
        "torch": str(torch.__version__),
        "shape": {"heads": 12, "head_dim": 64, "dtype": "bfloat16"},
        "settings": {
            "clusters": 25,
            "topk": 32,
            "bits": 63,
            "iterations": 10,
            "mode": "i-clustered",
            "growth": 0,
        },
        "timing": f"median of {repeats} {'CUDA-event' if DEVICE == 'cuda' else 'wall-clock'} timings "
        "after one warm-up",
        "rows": [],
        "i_clustered_plus": [],
    }

    def measured(key: str, fn, batch: int, n: int) -> None:
        try:
            row = fn(batch, n, repeats)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: record and go on
            row = {"batch": batch, "n": n, "error": f"{type(error).__name__}: {error}"[:500]}
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        result[key].append(row)
        output.write_text(json.dumps(result, indent=1))
        brief = {name: round(val, 3) if isinstance(val, float) else val for name, val in row.items()}
        brief.pop("ops_ms", None)
        print(json.dumps(brief), flush=True)

    for batch in batches:
        for n in lengths:
            measured("rows", bench_case, batch, n)
    for batch in plus:
        for n in lengths:
            measured("i_clustered_plus", plus_case, batch, n)
    result["mixed_batch_memory"] = mixed_batch_memory(max(lengths) // 2 or 1, max(batches))
    output.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["mixed_batch_memory"]), flush=True)
    print(f"wrote {output}")
    errors = [row for row in result["rows"] if "error" in row]
    return 1 if errors else 0


def mixed_batch_memory(n: int = 16384, batch: int = 16) -> dict:
    """Peak memory added by one call on padded rows of mixed lengths up to n: i-clustered vs SDPA (mask)."""
    heads, dim, dtype = 12, 64, torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(n // 8, 1), n + 1, (batch,), generator=generator)
    lengths[0] = n
    valid = (torch.arange(n)[None, :] < lengths[:, None]).to(DEVICE)
    q, k, v = (torch.randn(batch, heads, n, dim, device=DEVICE, dtype=dtype) for _ in range(3))
    out = {"n": n, "batch": batch, "mode": "i-clustered (no growth)", "lengths": lengths.tolist()}
    if DEVICE != "cuda":
        clustered_attention(q, k, v, valid, kernel_config())
        out["status"] = STUB
        return out

    def peak(fn) -> float:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    try:
        out["i_clustered_peak_mib"] = peak(lambda: clustered_attention(q, k, v, valid, kernel_config()))
    except Exception as error:  # noqa: BLE001
        out["i_clustered_error"] = f"{type(error).__name__}: {error}"
    try:
        mask = valid[:, None, None, :]
        out["sdpa_masked_peak_mib"] = peak(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        )
    except Exception as error:  # noqa: BLE001
        out["sdpa_error"] = f"{type(error).__name__}: {error}"
    return out


def run_pytest(output: Path, args: list[str]) -> int:
    """pytest with ``-rs``, its counts written to ``output``; a failure when any test was skipped or none
    passed (``pytest -m cuda`` on a machine whose kernels lack CUDA skips everything and exits 0)."""
    import xml.etree.ElementTree as ElementTree

    report = output.with_suffix(".xml")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        *args,
        f"--junitxml={report}",
    ]
    returncode = subprocess.run(command, cwd=ROOT).returncode
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.is_file():
        for suite in ElementTree.parse(report).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        report.unlink()
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    problems = []
    if returncode not in (0, 5):
        problems.append(f"pytest exited {returncode}")
    if counts["skipped"]:
        problems.append(
            f"{counts['skipped']} skipped (see the -rs reasons above): a skip here hides a GPU check"
        )
    if counts["passed"] == 0:
        problems.append("no test passed")
    summary = {"returncode": returncode, **counts, "problems": problems, "args": args}
    output.write_text(json.dumps(summary, indent=1))
    print(
        f"gpu_checks pytest: {counts['passed']} passed, {counts['skipped']} skipped, "
        f"{counts['failures'] + counts['errors']} failed"
        + ("; FAILED: " + "; ".join(problems) if problems else "")
    )
    return 1 if problems else 0


def main() -> int:
    global DEVICE, BACKEND, SHRINK
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["checks", "quick", "bench", "pytest"])
    parser.add_argument("--output", type=Path, default=Path("gpu_checks.json"))
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the CPU kernels stand in for CUDA, on smaller shapes (a dry run)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--plus-batches",
        type=int,
        nargs="*",
        default=[1, 16],
        help="batches at which i-clustered+ (convert's default) is timed, apart",
    )
    parser.add_argument("--repeats", type=int, default=5)
    args, rest = parser.parse_known_args()
    if args.what == "pytest":
        return run_pytest(args.output, [arg for arg in rest if arg != "--"])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    DEVICE = BACKEND = args.device
    if args.device == "cpu":
        SHRINK = 4
    elif not torch.cuda.is_available():
        print("gpu_checks: no CUDA GPU visible (--device cpu runs the CPU stand-in)")
        return 1
    if args.what == "checks":
        return checks(args.output)
    if args.what == "quick":
        return quick()
    return bench(args.output, args.lengths, args.batches, args.repeats, args.plus_batches)


if __name__ == "__main__":
    sys.exit(main())
