"""``clustered_heads``: every step of one attention call in one CPU op, against those steps one by one.

The op runs the steps' own functions (kernels/cpu/steps.h) per (row, head) in one parallel region, or step
by step when there are fewer (row, head)s than threads; either way its output must be the composed steps'
bit for bit, in every mode, dtype and padding layout, whatever the thread count.
"""

from __future__ import annotations

import pytest
import torch

from bert_cluster import attention, dispatch
from bert_cluster.config import ClusteredAttentionConfig

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_properties import CASES, Case, cases  # noqa: E402

MODES = ("clustered", "i-clustered", "i-clustered+")


class StepByStep(dispatch.CpuKernelBackend):
    """The CPU kernels without the fused op: attention._clustered composes their steps one by one."""

    clustered_heads = None


def _require_cpu() -> None:
    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"cpu kernels unavailable: {why}")


def _both(case: Case, mode: str, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, composed) outputs of attention._clustered for the case's tensors and settings."""
    q, k, v, valid = case.tensors()
    config = case.config.replace(mode=mode, backend="cpu")
    args = (q, k, v, valid, config, config.clusters, config.topk, case.scaling, 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = attention._clustered(dispatch.CpuKernelBackend(), *args)
        composed = attention._clustered(StepByStep(), *args)
    finally:
        torch.set_num_threads(previous)
    return fused, composed


@CASES
@given(case=cases(), mode=st.sampled_from(MODES), threads=st.sampled_from([1, 2, 4]))
def test_the_fused_op_gives_its_steps_bit_for_bit(case: Case, mode: str, threads: int) -> None:
    _require_cpu()
    fused, composed = _both(case, mode, threads)
    assert fused.dtype == composed.dtype == torch.float32
    assert torch.equal(fused, composed), f"{mode}, {threads} threads: {float((fused - composed).abs().max())}"


@CASES
@given(case=cases(), mode=st.sampled_from(MODES), threads=st.sampled_from([1, 2]))
def test_the_partition_variant_keeps_the_steps_partition(case: Case, mode: str, threads: int) -> None:
    """clustered_heads_partition: clustered_heads' output, and the partition the steps one by one give
    (what a recording pass saves for the backward, attention._StepsWithBackward), bit for bit."""
    _require_cpu()
    from bert_cluster import ops

    q, k, v, valid = case.tensors()
    config = case.config.replace(mode=mode, backend="cpu")
    planes, offsets, *settings = attention.step_arguments(
        config, config.clusters, config.topk, case.scaling, 2, q
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, *kept = ops.clustered_heads_partition(q, k, v, valid, planes, offsets, *settings)
        alone = ops.clustered_heads(q, k, v, valid, planes, offsets, *settings)
        p = attention.partition(StepByStep(), q, k, v, valid, planes, offsets, *settings)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out, alone), f"{mode}: the output differs from clustered_heads'"
    names = ("assignments", "centroids", "centroid_values", "topk_indices", "topk_mass", "topk_values")
    for name, got in zip(names, kept, strict=True):
        expected = getattr(p, name)
        assert got.shape == expected.shape, f"{mode} {name}: {tuple(got.shape)} vs {tuple(expected.shape)}"
        assert torch.equal(got.to(expected.dtype), expected), f"{mode} {name} differs from the steps'"


@pytest.mark.parametrize("mode", MODES)
def test_both_schedules_give_one_answer(mode: str) -> None:
    """Per (row, head) in one region (6 heads, 2 threads) and step by step (6 heads, 8 threads): the same."""
    _require_cpu()
    config = ClusteredAttentionConfig(
        clusters=7, topk=9, bits=31, iterations=6, mode=mode, min_length=0, cluster_growth=0, topk_growth=0
    )
    case = Case(2, 3, 300, 40, 24, "bf16", ["left", "holes"], "gaussian", config, 0.2, 11)
    per_head, composed = _both(case, mode, 2)
    step_by_step, _ = _both(case, mode, 8)
    assert torch.equal(per_head, composed) and torch.equal(step_by_step, composed)
    assert per_head.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_half_inputs_give_the_float32_call_on_their_values(mode: str, dtype: torch.dtype) -> None:
    """fp16/bf16 rows are widened to exactly their float32 values (in registers by the steps, a whole head at
    a time into a worker's buffer by the per-head schedule), so the call equals the float32 call bit for bit,
    on both schedules (6 heads on 2 threads: per head; on 8 threads: step by step)."""
    _require_cpu()
    from bert_cluster import ops

    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 150, 24, generator=generator).to(dtype) for _ in range(3))
    valid = torch.ones(2, 150, dtype=torch.bool)
    valid[0, :9] = False
    valid[1, 100:] = False
    planes, offsets = attention.hash_planes(0, 1, 31, 24)
    rounds = 1 if mode == "i-clustered+" else 0
    previous = torch.get_num_threads()
    try:
        for threads in (2, 8):
            torch.set_num_threads(threads)
            half = ops.clustered_heads(q, k, v, valid, planes, offsets, 7, 9, 6, mode, rounds, 0.2)
            widened = ops.clustered_heads(
                q.float(), k.float(), v.float(), valid, planes, offsets, 7, 9, 6, mode, rounds, 0.2
            )
            assert torch.equal(half, widened), f"{threads} threads: {float((half - widened).abs().max())}"
            assert half[:, :, 9:100].abs().sum() > 0
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [3072, 11000])
def test_large_half_heads_of_i_clustered_plus_give_the_float32_call(n: int, dtype: torch.dtype) -> None:
    """i-clustered+ on fp16/bf16 heads over 1 MiB: up to 8 MiB widened (3,072 x (64 + 64 + 64) floats:
    2.3 MiB) they run per head, widened once, and beyond (11,000: 8.1 MiB) step by step
    (kernels/cpu/pipeline.cpp); either way the call equals the float32 call on the same values bit for bit."""
    _require_cpu()
    from bert_cluster import ops

    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, n, 64, generator=generator).to(dtype) for _ in range(3))
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, n - 100 :] = False
    planes, offsets = attention.hash_planes(0, 1, 63, 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        half = ops.clustered_heads(q, k, v, valid, planes, offsets, 25, 32, 10, "i-clustered+", 2, 0.125)
        widened = ops.clustered_heads(
            q.float(), k.float(), v.float(), valid, planes, offsets, 25, 32, 10, "i-clustered+", 2, 0.125
        )
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(half, widened), f"{float((half - widened).abs().max())}"
    assert half[:, :, : n - 100].abs().sum() > 0 and half[:, :, n - 100 :].abs().sum() == 0


def test_the_cpu_backend_runs_the_fused_op(monkeypatch) -> None:
    """clustered_attention on the CPU kernels goes through clustered_heads, once per row group."""
    _require_cpu()
    from bert_cluster import ops

    calls = []
    original = ops.clustered_heads.overload  # the op's dispatcher call

    def spy(*args):
        calls.append(args[9])
        return original(*args)

    monkeypatch.setattr(ops.clustered_heads, "overload", spy)
    q, k, v = (torch.randn(2, 2, 80, 16) for _ in range(3))
    config = ClusteredAttentionConfig(clusters=5, topk=6, min_length=0, backend="cpu")
    attention.clustered_attention(q, k, v, None, config)
    assert calls == [config.mode]


@pytest.mark.parametrize("mode", ["i-clustered", "i-clustered+"])
def test_no_topk_keys_leaves_the_clustered_output(mode: str) -> None:
    """topk = 0: no key is refined, so the improved modes give clustered attention's output exactly (the op
    reads the top-k mass and values as zeros then, which the other settings overwrite per cluster)."""
    _require_cpu()
    from bert_cluster import ops

    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 50, 16, generator=generator) for _ in range(3))
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, 30:] = False
    planes, offsets = attention.hash_planes(0, 0, 20, 16)
    for _ in range(2):  # the second call reuses the first one's freed memory
        clustered = ops.clustered_heads(q, k, v, valid, planes, offsets, 6, 0, 5, "clustered", 0, 0.25)
        improved = ops.clustered_heads(q, k, v, valid, planes, offsets, 6, 0, 5, mode, 0, 0.25)
        assert torch.equal(improved, clustered)
        assert clustered[1, :, 30:].abs().sum() == 0 and clustered[0].abs().sum() > 0


def test_the_output_is_laid_out_as_transformers_takes_it_and_the_fake_says_so() -> None:
    # (R, H, N, Dv) viewed on (R, N, H, Dv) memory; torch.compile plans with the fake's strides, so a fake
    # that said contiguous would make compiled code read the values in the wrong places.
    _require_cpu()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bert_cluster import ops

    q, k, v = (torch.randn(2, 3, 40, 8) for _ in range(3))
    valid = torch.ones(2, 40, dtype=torch.bool)
    planes, offsets = attention.hash_planes(0, 0, 12, 8)
    for mode in MODES:
        out = ops.clustered_heads(q, k, v, valid, planes, offsets, 4, 5, 3, mode, 1, 0.35)
        assert out.shape == (2, 3, 40, 8) and out.transpose(1, 2).is_contiguous()
        with FakeTensorMode() as fake_mode:
            fakes = [fake_mode.from_tensor(t) for t in (q, k, v, valid, planes, offsets)]
            fake = ops.clustered_heads(*fakes, 4, 5, 3, mode, 1, 0.35)
        assert fake.shape == out.shape and fake.stride() == out.stride()


def test_opcheck() -> None:
    _require_cpu()
    from bert_cluster import ops

    ops._ensure_loaded()
    q, k, v = (torch.randn(1, 2, 33, 8) for _ in range(3))
    valid = torch.ones(1, 33, dtype=torch.bool)
    valid[0, 30:] = False
    planes, offsets = attention.hash_planes(0, 0, 12, 8)
    for mode in MODES:
        args = (q, k, v, valid, planes, offsets, 4, 5, 3, mode, 1, 0.35)
        torch.library.opcheck(torch.ops.bert_cluster.clustered_heads.default, args)
        torch.library.opcheck(torch.ops.bert_cluster.clustered_heads_partition.default, args)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"mode": "fast"}, ValueError, "mode must be clustered, i-clustered or i-clustered\\+"),
        ({"clusters": 0}, ValueError, "clusters must be >= 1"),
        ({"topk": -1}, ValueError, "topk must be >= 0"),
        ({"lloyd_rounds": -1}, ValueError, "lloyd_rounds must be >= 0"),
        ({"planes": torch.randn(12, 5)}, ValueError, "planes must be \\(B, Dk\\)"),
        ({"valid": torch.ones(1, 32, dtype=torch.bool)}, ValueError, "valid must have shape"),
        ({"values": torch.randn(1, 2, 33, 8).double()}, TypeError, "values must be float32"),
    ],
)
def test_bad_input_raises(change: dict, error: type, match: str) -> None:
    _require_cpu()
    from bert_cluster import ops

    planes, offsets = attention.hash_planes(0, 0, 12, 8)
    args = {
        "queries": torch.randn(1, 2, 33, 8),
        "keys": torch.randn(1, 2, 33, 8),
        "values": torch.randn(1, 2, 33, 8),
        "valid": torch.ones(1, 33, dtype=torch.bool),
        "planes": planes,
        "offsets": offsets,
        "clusters": 4,
        "topk": 5,
        "iterations": 3,
        "mode": "i-clustered",
        "lloyd_rounds": 1,
        "scaling": 0.35,
    }
    args.update(change)
    with pytest.raises(error, match=match):
        ops.clustered_heads(*args.values())
