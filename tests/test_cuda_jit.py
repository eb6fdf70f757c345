"""The CUDA kernels' first-use build: when it may run, where it caches, what it says when it cannot.

The build itself (nvcc, a CUDA torch) is exercised by scripts/check_cuda_build.sh in CI, and on a GPU by
scripts/gpu_check.sh; here, on a CPU torch, the decisions around it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from bert_cluster import _cuda_jit, _cuda_sources, _loader, dispatch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_build_yet(monkeypatch):
    monkeypatch.setattr(_cuda_jit, "_result", {})
    monkeypatch.setattr(dispatch.CudaKernelBackend, "_first_use_done", False)
    monkeypatch.delenv("BERT_CLUSTER_CUDA_JIT", raising=False)
    _cuda_jit.nvcc.cache_clear()
    _cuda_jit._kernels.cache_clear()


def test_cpu_torch_is_told_apart_from_cpu_kernels_of_the_same_release() -> None:
    # CPU kernels carry over between builds of one release (+cpu, PyPI's CUDA build, +cu130) ...
    assert _loader.compatible_torch("2.13.0+cpu", "2.13.0", with_cuda=False)
    assert _loader.compatible_torch("2.13.0+cpu", "2.13.0+cu130", with_cuda=False)
    assert _loader.compatible_torch("2.13.0", "2.13.0", with_cuda=True)
    # ... but not to another release, and CUDA kernels need the very CUDA build they linked.
    assert not _loader.compatible_torch("2.13.0+cpu", "2.14.1+cpu", with_cuda=False)
    assert not _loader.compatible_torch("2.14.1+cu130", "2.14.1+cu128", with_cuda=True)


def test_sources_come_from_the_checkout_and_cover_every_cuda_file() -> None:
    kernels = _cuda_sources.kernels_dir()
    assert kernels == REPO / "kernels"
    listed = {path.name for path in _cuda_sources.source_files(kernels)}
    on_disk = {path.name for path in (REPO / "kernels" / "cuda").iterdir()} | {"checks.h"}
    assert listed == on_disk
    assert [p.name for p in _cuda_sources.cuda_sources(kernels)] == sorted(
        p.name for p in (REPO / "kernels" / "cuda").glob("*.cu")
    )


def test_a_changed_source_changes_the_cache_folder(tmp_path) -> None:
    copy = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", copy)
    before = _cuda_sources.sources_digest(copy)
    assert before == _cuda_sources.sources_digest(REPO / "kernels")
    header = copy / "cuda" / "common.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    assert _cuda_sources.sources_digest(copy) != before


def test_cache_folder_names_torch_cuda_architectures_and_sources(monkeypatch, tmp_path, no_build_yet) -> None:
    monkeypatch.setenv("BERT_CLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    folder = _cuda_jit.build_dir()
    digest = _cuda_sources.sources_digest(REPO / "kernels")
    assert folder.parent == tmp_path / "cuda-kernels"
    torch_tag = str(torch.__version__).replace("+", "_")
    assert folder.name == f"torch{torch_tag}-cuda{torch.version.cuda}-sm80_90PTX-{digest}"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert _cuda_jit.build_dir() != folder


def test_reasons_it_cannot_build(monkeypatch, no_build_yet) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is a CPU build" in _cuda_jit.why_not()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_cuda_jit, "nvcc", lambda: None)
    assert _cuda_jit.why_not().startswith("no nvcc found (set CUDA_HOME to a CUDA 13.0 toolkit")
    monkeypatch.setattr(_cuda_jit, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert _cuda_jit.why_not() == ""
    monkeypatch.setattr(_cuda_jit, "_kernels", lambda: None)
    assert "carries no CUDA sources" in _cuda_jit.why_not()
    monkeypatch.setenv("BERT_CLUSTER_CUDA_JIT", "0")
    assert "BERT_CLUSTER_CUDA_JIT=0" in _cuda_jit.why_not()


def test_build_refused_once_is_the_cuda_backends_reason(monkeypatch, no_build_yet) -> None:
    state = _loader.load()
    if state["loaded"] and state["with_cuda"]:  # its CUDA kernels serve: no first-use build is asked for
        pytest.skip("needs a kernel build without CUDA (the first-use build's case)")
    monkeypatch.setattr(torch.version, "cuda", None)
    result = _cuda_jit.build()
    assert not result["ok"] and "CPU build" in result["reason"] and not _cuda_jit.loaded()
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a second call does not try again
    assert _cuda_jit.build() == result
    ok, why = dispatch.CudaKernelBackend.is_available()
    assert not ok and why.endswith(result["reason"])


def test_cuda_backend_names_the_first_use_build(monkeypatch, no_build_yet) -> None:
    state = _loader.load()
    if not state["loaded"] or state["with_cuda"]:
        pytest.skip("needs the CPU-only kernel build of the test install")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_cuda_jit, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    ok, why = dispatch.CudaKernelBackend.is_available()
    assert not ok
    assert why == (
        "bert_cluster._C was built without CUDA; the CUDA kernels build on the first CUDA call "
        "(`bert-cluster kernels build --cuda`: now)"
    )


def test_first_cuda_inputs_trigger_one_build(monkeypatch, no_build_yet) -> None:
    state = _loader.load()
    if not state["loaded"] or state["with_cuda"]:
        pytest.skip("needs the CPU-only kernel build of the test install")
    calls = []
    monkeypatch.setattr(_cuda_jit, "build", lambda verbose=False: calls.append(1) or {"ok": False})
    monkeypatch.setattr(_cuda_jit, "why_not", lambda: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu = torch.zeros(1, 1, 4, 4)
    dispatch.CudaKernelBackend.not_supported_reasons(cpu)
    assert calls == []  # CPU inputs never build
    cuda_like = _OnCuda()
    dispatch.CudaKernelBackend.not_supported_reasons(cuda_like)
    dispatch.CudaKernelBackend.not_supported_reasons(cuda_like)
    assert calls == [1]


class _OnCuda:
    """What dispatch reads of an input, as a CUDA tensor would answer (this machine has no GPU)."""

    device = torch.device("cuda")
    dtype = torch.float32
    requires_grad = False
    shape = (1, 1, 4, 4)

    def dim(self) -> int:
        return 4
