"""The banded_attention op x backend x dtype: equal to the reference and to SDPA under the band mask."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import kernel_backends, require_kernels

from bert_cluster import dispatch
from bert_cluster import reference as ref

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: Max abs error against the reference on the same inputs (both compute in fp32 from the same values, so
#: the dtype only changes the inputs). Measured max over this file's cases, CPU kernels: fp32 7.2e-7,
#: fp16 6.0e-7, bf16 7.2e-7 -> 4e-6 (about 5x).
ATOL = 4e-6
#: Against SDPA (math backend, fp32) under the equivalent boolean mask: measured max 4.8e-7 -> 2e-6.
SDPA_ATOL = 2e-6


#: (N, window, Dk, Dv, padding): w = 0, w >= N, a ModernBERT-like band, odd head dims, Dv != Dk.
CASES = [
    (1, 0, 8, 8, "none"),
    (7, 0, 16, 16, "right"),
    (40, 3, 40, 24, "left"),
    (129, 64, 64, 64, "holes"),
    (300, 64, 64, 64, "right"),
    (300, 17, 72, 40, "all"),
    (96, 96, 32, 32, "holes"),
    (50, 500, 24, 48, "right"),
]


def _inputs(n, dk, dv, padding, dtype, rows=3, heads=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, n, dk, generator=generator).to(dtype)
    k = torch.randn(rows, heads, n, dk, generator=generator).to(dtype)
    v = torch.randn(rows, heads, n, dv, generator=generator).to(dtype)
    valid = torch.ones(rows, n, dtype=torch.bool)
    if padding == "right":
        valid[1, n - max(1, n // 3) :] = False
    elif padding == "left":
        valid[1, : max(1, n // 3)] = False
    elif padding == "holes":
        valid[1, ::3] = False
        valid[2, n // 2 :] = False
    elif padding == "all":
        valid[1] = False  # a row with no valid token at all
        valid[2, : n // 2] = False
    return q, k, v, valid


def _band_mask(n: int, window: int, valid: torch.Tensor) -> torch.Tensor:
    position = torch.arange(n)
    band = (position[:, None] - position[None, :]).abs() <= window
    return band[None, None] & valid[:, None, None, :]  # (R, 1, N, N)


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}-w{}-Dk{}-Dv{}-{}".format(*c))
def test_banded_attention_matches_reference(case, dtype: str, backend: str, device: str) -> None:
    require_kernels(backend)
    n, window, dk, dv, padding = case
    q, k, v, valid = _inputs(n, dk, dv, padding, DTYPES[dtype])
    scaling = 1 / math.sqrt(dk)
    expected = ref.banded_attention(q, k, v, valid, window, scaling)
    kernels = dispatch.BACKENDS[backend]
    got = kernels.banded_attention(
        q.to(device), k.to(device), v.to(device), valid.to(device), window, scaling
    )
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected, atol=ATOL, rtol=0)
    padded = ~valid[:, None, :, None].expand_as(expected)
    assert bool((got.cpu()[padded] == 0).all()), "padded queries must get zeros"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("window", [0, 5, 64, 1000])
def test_banded_attention_equals_sdpa_with_the_band_mask(
    window: int, dtype: str, backend: str, device: str
) -> None:
    require_kernels(backend)
    n = 200
    q, k, v, valid = _inputs(n, 32, 32, "holes", DTYPES[dtype], seed=1)
    mask = _band_mask(n, window, valid)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    visible = mask.any(-1, keepdim=True) & valid[:, None, :, None]
    expected = torch.where(visible, sdpa, torch.zeros_like(sdpa))  # SDPA gives NaN on a row with no key
    got = dispatch.BACKENDS[backend].banded_attention(
        q.to(device), k.to(device), v.to(device), valid.to(device), window, 1 / math.sqrt(32)
    )
    torch.testing.assert_close(got.cpu(), expected, atol=SDPA_ATOL, rtol=0)


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_windowed_attention_runs_the_kernel(backend: str, device: str) -> None:
    """attention.windowed_attention dispatches to the op on the kernel backends (not the reference)."""
    require_kernels(backend)
    from bert_cluster.attention import windowed_attention
    from bert_cluster.config import ClusteredAttentionConfig

    q, k, v, valid = _inputs(64, 16, 16, "right", torch.float32, seed=2)
    from bert_cluster import ops

    calls = []
    original = ops.banded_attention.overload

    def spy(*args):
        calls.append(args[4])
        return original(*args)

    config = ClusteredAttentionConfig(backend=backend)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops.banded_attention, "overload", spy)  # the op's dispatcher call
        out = windowed_attention(q.to(device), k.to(device), v.to(device), valid.to(device), 4, config)
    assert calls == [4]
    expected = ref.banded_attention(q, k, v, valid, 4, 0.25)
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)
