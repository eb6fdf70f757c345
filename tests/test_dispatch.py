"""Backend choice: auto's priority, forced backends and their reasons, a missing or stale build."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from bert_cluster import _build, _loader, dispatch


@pytest.fixture
def fresh_loader(monkeypatch):
    """A loader that has not run yet (restored afterwards), so load() can be replayed with a fake import."""
    monkeypatch.setattr(_loader, "_state", None)
    monkeypatch.setattr(_loader, "_warned", False)
    monkeypatch.delenv("BERT_CLUSTER_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("BERT_CLUSTER_BACKEND", raising=False)
    monkeypatch.setenv("BERT_CLUSTER_CPU_JIT", "0")  # a fake stale build must not compile for minutes
    return _loader


def _fail_import(monkeypatch, error: Exception) -> None:
    """Importing ``bert_cluster._C`` raises ``error``; every other import works (under a CUDA torch,
    ``describe()`` asks torch's extension builder for nvcc, which imports setuptools through importlib)."""
    real = importlib.import_module

    def import_module(name, *args, **kwargs):
        if name == "bert_cluster._C":
            raise error
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_loader.importlib, "import_module", import_module)


def test_priority_and_registry() -> None:
    assert dispatch.PRIORITY == ["cuda", "cpu", "reference"]
    assert set(dispatch.BACKENDS) == {"cuda", "cpu", "reference"}
    for name, backend in dispatch.BACKENDS.items():
        assert backend.name == name
        for step in dispatch.STEPS:
            assert callable(getattr(backend, step)), f"{name} lacks {step}"


def test_auto_picks_cpu_kernels_when_built(monkeypatch) -> None:
    monkeypatch.delenv("BERT_CLUSTER_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("BERT_CLUSTER_BACKEND", raising=False)
    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"CPU kernels not built: {why}")
    x = torch.zeros(1, 1, 4, 8)
    assert dispatch.select_backend("auto", x).name == "cpu"


def test_forced_cuda_on_cpu_tensors_lists_reasons() -> None:
    x = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot run.*device cpu not in \['cuda'\]"):
        dispatch.select_backend("cuda", x)


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown backend 'tpu'; allowed: auto, cuda, cpu, reference"):
        dispatch.select_backend("tpu", torch.zeros(1))


def test_inputs_that_require_grad_run_on_the_kernels(monkeypatch) -> None:
    # The kernels' ops have a registered backward (issue 38): training no longer falls back to the reference.
    monkeypatch.delenv("BERT_CLUSTER_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("BERT_CLUSTER_BACKEND", raising=False)
    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"CPU kernels unavailable: {why}")
    x = torch.zeros(1, 1, 4, 8, requires_grad=True)
    assert dispatch.CpuKernelBackend.not_supported_reasons(x) == []
    assert dispatch.select_backend("auto", x).name == "cpu"


def test_a_backend_without_dropout_refuses_it_with_the_reason(monkeypatch) -> None:
    """Attention dropout is decided at the one dispatch point: a backend whose kernels have none gives the
    reason, so a forced one raises and auto passes it by (the CUDA kernels have no dropout)."""
    monkeypatch.delenv("BERT_CLUSTER_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("BERT_CLUSTER_BACKEND", raising=False)
    x = torch.zeros(1, 1, 4, 8)
    why = "attention dropout (training, p=0.1): the cuda kernels have none"
    assert why in dispatch.CudaKernelBackend.not_supported_reasons(x, dropout=0.1)
    assert not any("dropout" in r for r in dispatch.CudaKernelBackend.not_supported_reasons(x, dropout=0.0))
    assert dispatch.ReferenceBackend.not_supported_reasons(x, dropout=0.1) == []
    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"CPU kernels not built: {why}")
    assert dispatch.select_backend("auto", x, dropout=0.1).name == "cpu"  # the CPU kernels drop
    monkeypatch.setattr(dispatch.CpuKernelBackend, "HAS_DROPOUT", False)
    assert dispatch.select_backend("auto", x).name == "cpu"
    assert dispatch.select_backend("auto", x, dropout=0.1).name == "reference"
    with pytest.raises(ValueError, match=r"backend 'cpu' cannot run.*dropout \(training, p=0.1\)"):
        dispatch.select_backend("cpu", x, dropout=0.1)


def test_disable_env_forces_reference(monkeypatch) -> None:
    monkeypatch.setenv("BERT_CLUSTER_DISABLE_KERNELS", "1")
    assert dispatch.select_backend("auto", torch.zeros(1)).name == "reference"
    assert dispatch.select_backend("cpu", torch.zeros(1)).name == "reference"


def test_backend_env_overrides_auto(monkeypatch) -> None:
    monkeypatch.delenv("BERT_CLUSTER_DISABLE_KERNELS", raising=False)
    monkeypatch.setenv("BERT_CLUSTER_BACKEND", "reference")
    assert dispatch.select_backend("auto", torch.zeros(1)).name == "reference"
    monkeypatch.setenv("BERT_CLUSTER_BACKEND", "gpu")
    with pytest.raises(ValueError, match="BERT_CLUSTER_BACKEND='gpu' is not a backend"):
        dispatch.select_backend("auto", torch.zeros(1))


def test_missing_build_falls_back_to_reference_and_warns_once(fresh_loader, monkeypatch) -> None:
    error = ModuleNotFoundError("No module named 'bert_cluster._C'", name="bert_cluster._C")
    _fail_import(monkeypatch, error)
    with pytest.warns(RuntimeWarning, match="absent: bert_cluster._C is not built"):
        assert dispatch.select_backend("auto", torch.zeros(1)).name == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second failure must not warn again
        assert dispatch.select_backend("auto", torch.zeros(1)).name == "reference"
        with pytest.raises(ValueError, match="backend 'cpu' cannot run.*absent"):
            dispatch.select_backend("cpu", torch.zeros(1))
    described = {entry["backend"]: entry for entry in dispatch.describe()}
    assert not described["cpu"]["available"] and "absent" in described["cpu"]["reason"]
    assert described["reference"]["available"]


def test_stale_build_is_reported(fresh_loader, monkeypatch) -> None:
    error = ImportError("/x/_C.abi3.so: undefined symbol: _ZN3c104impl8GPUTrace")
    _fail_import(monkeypatch, error)
    with pytest.warns(RuntimeWarning, match="built for another torch"):
        state = _loader.load()
    assert not state["loaded"] and "undefined symbol" in state["reason"]


def test_other_import_error_is_reported(fresh_loader, monkeypatch) -> None:
    _fail_import(monkeypatch, ImportError("libgomp.so.1: cannot open shared object file"))
    with pytest.warns(RuntimeWarning, match="import error: libgomp"):
        ok, why = dispatch.CpuKernelBackend.is_available()
    assert not ok and why.startswith("import error")


def test_disabled_kernels_do_not_warn(fresh_loader, monkeypatch) -> None:
    monkeypatch.setenv("BERT_CLUSTER_DISABLE_KERNELS", "1")
    _fail_import(monkeypatch, ModuleNotFoundError("gone", name="bert_cluster._C"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loader.load()
        assert dispatch.select_backend("auto", torch.zeros(1)).name == "reference"


def test_build_info_reports_everything() -> None:
    info = _build.build_info()
    for key in (
        "torch",
        "torch_cuda",
        "cuda_available",
        "compiler",
        "kernels_loaded",
        "kernels_reason",
        "kernels_with_cuda",
        "kernels_cpu_isa",
        "kernels_cpu_isas_built",
        "backends",
        "auto_backend_cpu",
    ):
        assert key in info, key
    if info["kernels_loaded"]:  # the CPU kernel library that loaded is one the build made
        assert info["kernels_cpu_isa"] in info["kernels_cpu_isas_built"]
    assert info["torch"] == str(torch.__version__)
    assert [b["backend"] for b in info["backends"]] == ["cuda", "cpu", "reference"]
    cuda = next(b for b in info["backends"] if b["backend"] == "cuda")
    if not torch.cuda.is_available():
        assert not cuda["available"] and cuda["reason"]


def test_build_kernels_needs_a_source_checkout(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(_build, "_ROOT", tmp_path)
    result = _build.build_kernels()
    assert result["ok"] is False and "no setup.py" in result["log"]
    assert result["cpu_ops"] == [] and result["cuda_ops"] == []


def test_loader_imports_only_the_environment_from_the_package() -> None:
    """No import circle: environment <- _loader <- ops <- dispatch <- _build; the build lives in _build."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(_loader))
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [alias.name for node in imports for alias in node.names] + [
        node.module or "" for node in imports if isinstance(node, ast.ImportFrom)
    ]
    assert [name for name in names if name.startswith("bert_cluster")] == ["bert_cluster"], names
    assert "environment" in names
    assert not hasattr(_loader, "build_info") and not hasattr(_loader, "build_kernels")


def test_registered_kernels_are_checked_per_device(fresh_loader, monkeypatch) -> None:
    """A _C that loads but lacks an op's kernel for a device: that backend is unavailable, naming the op."""
    from bert_cluster import ops

    real = _loader.has_kernel
    monkeypatch.setattr(_loader, "has_kernel", lambda op, key: op != "topk_refine" and real(op, key))
    state = ops.load_kernels()
    if not state["loaded"]:
        pytest.skip(f"CPU kernels not built: {state['reason']}")
    ok, why = dispatch.CpuKernelBackend.is_available()
    assert not ok and "no CPU kernel for topk_refine" in why


def test_cuda_declares_its_head_dim_limit() -> None:
    """Head dims above 512 are a reason on the CUDA backend (auto then falls back), whatever the device."""
    big = torch.zeros(1, 1, 2, 513)
    reasons = dispatch.CudaKernelBackend.not_supported_reasons(big)
    assert any("above 512" in reason for reason in reasons)
    assert not any(
        "above 512" in r for r in dispatch.CudaKernelBackend.not_supported_reasons(torch.zeros(1, 1, 2, 512))
    )
    assert not any("above 512" in r for r in dispatch.CpuKernelBackend.not_supported_reasons(big))


def test_stale_build_builds_the_cpu_kernels_on_first_use(fresh_loader, monkeypatch) -> None:
    monkeypatch.setenv("BERT_CLUSTER_CPU_JIT", "1")
    monkeypatch.setattr(_loader, "_cpu_library", [])
    _fail_import(monkeypatch, ImportError("/x/_C.abi3.so: undefined symbol: _ZN3c104impl8GPUTrace"))
    built = {"ok": True, "reason": "", "path": "/cache/cpu-kernels/lib.so", "label": "x86_64_v3"}
    state = _loader.load(first_use=lambda: built)
    assert state["loaded"] and state["built_on_first_use"] and state["reason"] == ""
    assert state["cpu_library"] == built["path"] and state["torch_version"] == str(torch.__version__)


def test_failed_first_use_cpu_build_is_part_of_the_reason(fresh_loader, monkeypatch) -> None:
    monkeypatch.setenv("BERT_CLUSTER_CPU_JIT", "1")
    monkeypatch.setattr(_loader, "_cpu_library", [])
    _fail_import(monkeypatch, ImportError("/x/_C.abi3.so: undefined symbol: _ZN3c104impl8GPUTrace"))
    failed = {"ok": False, "reason": "the first-use CPU build failed (no compiler)", "path": None}
    with pytest.warns(RuntimeWarning, match="built for another torch.*the first-use CPU build failed"):
        state = _loader.load(first_use=lambda: failed)
    assert not state["loaded"]
