"""The CPU kernel libraries, one per x86-64 ISA level: which one loads, and that they agree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_cluster import _loader, ops

LIBRARIES = [("x86_64_v4", 4), ("x86_64_v3", 3), ("x86_64", 1)]
#: Libraries whose CPUs have FMA: their kernels round alike (x86_64, SSE2, has no fused multiply-add).
FMA_LIBRARIES = ("x86_64_v4", "x86_64_v3")
REPO = Path(__file__).resolve().parents[1]


def test_the_best_library_the_cpu_runs_is_chosen() -> None:
    assert _loader.choose_cpu_library(LIBRARIES, 4, None) == "x86_64_v4"
    assert _loader.choose_cpu_library(LIBRARIES, 3, None) == "x86_64_v3"
    assert _loader.choose_cpu_library(LIBRARIES, 2, None) == "x86_64"
    assert _loader.choose_cpu_library([("native", 0)], 0, None) == "native"


def test_a_requested_library_is_chosen_or_refused_clearly() -> None:
    assert _loader.choose_cpu_library(LIBRARIES, 4, "x86-64-v3") == "x86_64_v3"
    assert _loader.choose_cpu_library(LIBRARIES, 4, "x86_64") == "x86_64"
    with pytest.raises(
        ValueError, match=r"'avx9' names no CPU kernel library of this build; built: \['x86_64_v4"
    ):
        _loader.choose_cpu_library(LIBRARIES, 4, "avx9")
    with pytest.raises(ValueError, match=r"this CPU lacks that ISA; it runs: \['x86_64_v3', 'x86_64'\]"):
        _loader.choose_cpu_library(LIBRARIES, 3, "x86_64_v4")
    with pytest.raises(ValueError, match="runs none of the CPU kernel libraries"):
        _loader.choose_cpu_library([("x86_64_v4", 4)], 3, None)


def _setup_extensions(monkeypatch, **variables: str) -> list[str]:
    """The extension modules setup.py would build under ``variables`` (nothing compiled)."""
    import runpy

    import setuptools

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    for name in ("BERT_CLUSTER_ONLY_THIS_CPU", "BERT_CLUSTER_MARCH", "BERT_CLUSTER_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
    return [extension.name for extension in captured["ext_modules"]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="setup.py reads this CPU's level from /proc")
def test_a_demo_build_makes_only_the_library_this_cpu_loads(monkeypatch) -> None:
    state = _loader.load()
    if not state["loaded"] or state["cpu_level"] < 1 or len(state["cpu_isas"]) < 3:
        pytest.skip("needs the portable x86-64 build of the test install (three CPU libraries)")
    everything = _setup_extensions(monkeypatch)
    assert everything == ["bert_cluster._C", *(f"bert_cluster._C_cpu_{label}" for label, _ in LIBRARIES)]
    # setup.py's reading of /proc/cpuinfo must pick the library the loader picks by the compiler's builtins.
    best = _loader.choose_cpu_library(LIBRARIES, state["cpu_level"], None)
    only = _setup_extensions(monkeypatch, BERT_CLUSTER_ONLY_THIS_CPU="1")
    assert only == ["bert_cluster._C", f"bert_cluster._C_cpu_{best}"]


def test_the_build_listing_is_read() -> None:
    class Module:
        CPU_LIBS = "x86_64_v4:4,x86_64:1"

    class OldModule:
        pass

    assert _loader.cpu_libraries(Module) == [("x86_64_v4", 4), ("x86_64", 1)]
    assert _loader.cpu_libraries(OldModule) == []


def _runnable() -> list[str]:
    state = ops.load_kernels()
    if not state["loaded"]:
        pytest.skip(f"kernels not built: {state['reason']}")
    assert state["cpu_isa"] in state["cpu_isas"]
    levels = dict(_loader.cpu_libraries(__import__("bert_cluster._C", fromlist=["_C"])))
    return [label for label in state["cpu_isas"] if levels[label] <= state["cpu_level"]]


_CHILD = r"""
import sys, torch
from bert_cluster import ops
from bert_cluster.attention import clustered_attention
from bert_cluster.config import ClusteredAttentionConfig
state = ops.load_kernels()
assert state["cpu_isa"] == sys.argv[1], state
torch.set_num_threads(2)
out = {}
for n, dtype in ((97, torch.float32), (700, torch.float32), (300, torch.bfloat16)):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 3, n, 64, generator=g).to(dtype) for _ in range(3))
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, (2 * n) // 3 :] = False
    for mode in ("clustered", "i-clustered", "i-clustered+"):
        config = ClusteredAttentionConfig(
            clusters=25, topk=32, min_length=0, cluster_growth=0, topk_growth=0, backend="cpu", mode=mode
        )
        out[f"{n} {dtype} {mode}"] = clustered_attention(q, k, v, valid, config).float()
torch.save(out, sys.argv[2])
"""


def _outputs(label: str, folder: Path) -> dict[str, torch.Tensor]:
    path = folder / f"{label}.pt"
    env = {**os.environ, _loader.ISA_ENV: label}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, label, str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(path)


def test_every_isa_library_gives_the_same_results(tmp_path: Path) -> None:
    """AVX-512 and AVX2 kernels agree bit for bit (the same lanes and operation order, FMA in both); the SSE2
    library, which has no FMA, agrees to float rounding. Fails if a library takes another summation order."""
    runnable = _runnable()
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs one CPU kernel library only: {runnable}")
    results = {label: _outputs(label, tmp_path) for label in runnable}
    best = results[runnable[0]]
    for label, got in results.items():
        for case, expected in best.items():
            if label in FMA_LIBRARIES and runnable[0] in FMA_LIBRARIES:
                assert torch.equal(got[case], expected), f"{label} differs from {runnable[0]}: {case}"
            else:  # measured: fp32 <= 3.6e-7, bf16 <= 9.8e-4 (a quarter of a bf16 step at 0.5-1)
                atol = 4e-3 if "bfloat16" in case else 2e-6
                torch.testing.assert_close(got[case], expected, atol=atol, rtol=0, msg=f"{label}: {case}")
