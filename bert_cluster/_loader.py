"""Guarded, lazy loading of the compiled kernels (``bert_cluster._C``), and the facts of the build.

Nothing here runs at ``import bert_cluster``: the first kernel dispatch (or ``info()``) calls ``load()``,
which defines the op schemas (``bert_cluster.ops``), imports ``_C`` (whose ``TORCH_LIBRARY_IMPL`` blocks
register the CPU and CUDA implementations) and remembers why that failed, if it did: absent, built for
another torch, or another import error. A failure is reported once, as a ``RuntimeWarning``; the library
then runs on the reference.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parent.parent  # the source checkout (setup.py lives here)
_BUILD_HINT = "build it with `pip install --no-build-isolation -e .` or `bert-cluster kernels build`"

_state: dict[str, Any] | None = None  # filled by load(); read by everything else
_warned = False


def _has_kernel(op: str, key: str) -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"bert_cluster::{op}", key))


def load() -> dict[str, Any]:
    """Import ``bert_cluster._C`` once; returns the load state (``loaded``, ``reason``, build facts)."""
    global _state
    if _state is not None:
        return _state
    from bert_cluster import ops  # defines the schemas before the implementations register

    state: dict[str, Any] = {"loaded": False, "reason": "", "torch_version": None, "with_cuda": False}
    try:
        module = importlib.import_module("bert_cluster._C")
    except ModuleNotFoundError as error:
        if error.name not in ("bert_cluster._C", "bert_cluster"):
            state["reason"] = f"import error: {error}"
        else:
            state["reason"] = f"absent: bert_cluster._C is not built ({_BUILD_HINT})"
    except ImportError as error:  # e.g. undefined symbol: compiled against another libtorch
        text = str(error)
        if "undefined symbol" in text or "version" in text.lower():
            state["reason"] = (
                f"built for another torch (running {torch.__version__}): {text}; rebuild: {_BUILD_HINT}"
            )
        else:
            state["reason"] = f"import error: {text}"
    except OSError as error:
        state["reason"] = f"import error: {error}"
    else:
        built_for = getattr(module, "TORCH_VERSION", "unknown")
        state.update(
            torch_version=built_for,
            with_cuda=bool(getattr(module, "WITH_CUDA", 0)),
            compiler=getattr(module, "COMPILER", "unknown"),
            path=getattr(module, "__file__", None),
        )
        if built_for != str(torch.__version__):
            state["reason"] = (
                f"built for another torch ({built_for}, running {torch.__version__}); rebuild: {_BUILD_HINT}"
            )
        elif not all(_has_kernel(op, "CPU") for op in ops.KERNEL_OPS):
            missing = [op for op in ops.KERNEL_OPS if not _has_kernel(op, "CPU")]
            state["reason"] = f"import error: _C registered no CPU kernel for {', '.join(missing)}"
        else:
            state["loaded"] = True
    _state = state
    if not state["loaded"]:
        _warn_once(state["reason"])
    return state


def _warn_once(reason: str) -> None:
    global _warned
    if _warned or os.environ.get("BERT_CLUSTER_DISABLE_KERNELS", "") not in ("", "0"):
        return
    _warned = True
    warnings.warn(
        f"bert_cluster: compiled kernels unavailable, running the PyTorch reference instead: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )


def cpu_available() -> tuple[bool, str]:
    """Whether the CPU kernels can run here, and why not."""
    state = load()
    return (True, "") if state["loaded"] else (False, state["reason"])


def cuda_available() -> tuple[bool, str]:
    """Whether the CUDA kernels can run here, and why not (build, registration, then a visible GPU)."""
    state = load()
    if not state["loaded"]:
        return False, state["reason"]
    if not state["with_cuda"]:
        return False, "bert_cluster._C was built without CUDA (rebuild with BERT_CLUSTER_BUILD_CUDA=1)"
    from bert_cluster import ops

    missing = [op for op in ops.KERNEL_OPS if not _has_kernel(op, "CUDA")]
    if missing:
        return False, f"_C registered no CUDA kernel for {', '.join(missing)}"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    return True, ""


def _compiler_version() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    if not compiler:
        return "none found"
    try:
        first = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=20).stdout
        return first.splitlines()[0] if first else compiler
    except (OSError, subprocess.SubprocessError) as error:
        return f"{compiler} ({error})"


def build_info() -> dict[str, Any]:
    """Versions, the kernel build's status and each backend's availability (``bert-cluster env``)."""
    from bert_cluster import dispatch

    state = load()
    try:
        auto_cpu = dispatch.select_backend("auto", torch.empty(0)).name
    except ValueError as error:
        auto_cpu = f"none ({error})"
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "compiler": state.get("compiler") or _compiler_version(),
        "threads": torch.get_num_threads(),
        "parallel_backend": "OpenMP" if "OpenMP" in torch.__config__.parallel_info() else "native",
        "kernels_loaded": state["loaded"],
        "kernels_reason": state["reason"],
        "kernels_path": state.get("path"),
        "kernels_built_for_torch": state["torch_version"],
        "kernels_with_cuda": state["with_cuda"],
        "kernels_disabled_by_env": os.environ.get("BERT_CLUSTER_DISABLE_KERNELS", "") not in ("", "0"),
        "backend_env": os.environ.get("BERT_CLUSTER_BACKEND") or None,
        "backends": dispatch.describe(),
        "auto_backend_cpu": auto_cpu,
    }


def build_kernels(cuda: bool = False, verbose: bool = False) -> dict[str, Any]:
    """Build ``bert_cluster._C`` in place (``setup.py build_ext --inplace``) from the source checkout.

    Runs in a subprocess, so a process that already loaded an older ``_C`` is unaffected; the new build
    is then imported in a fresh interpreter to say which ops it registered. ``cuda`` adds the CUDA
    kernels (``BERT_CLUSTER_BUILD_CUDA=1``; ``TORCH_CUDA_ARCH_LIST`` defaults to ``8.0;9.0+PTX``).

    Returns:
        ``ok``, ``cuda``, ``seconds``, ``path`` of the built module, ``cpu_ops`` / ``cuda_ops``
        registered, ``returncode`` and ``log`` (the last lines of the build output, all of it with verbose).
    """
    setup_py = _ROOT / "setup.py"
    result: dict[str, Any] = {
        "ok": False,
        "cuda": cuda,
        "seconds": 0.0,
        "path": None,
        "cpu_ops": [],
        "cuda_ops": [],
    }
    if not setup_py.is_file():
        result["log"] = f"no setup.py at {_ROOT}: building needs a source checkout of bert-cluster"
        return result
    env = dict(os.environ)
    env.pop("BERT_CLUSTER_SKIP_KERNELS", None)
    env["BERT_CLUSTER_BUILD_CUDA"] = "1" if cuda else "0"
    if cuda:
        env.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        if "CUDA_HOME" not in env and Path("/usr/local/cuda").is_dir():
            env["CUDA_HOME"] = "/usr/local/cuda"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(setup_py), "build_ext", "--inplace"],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["returncode"] = proc.returncode
    log = proc.stdout + proc.stderr
    result["log"] = log if verbose else "\n".join(log.splitlines()[-20:])
    if proc.returncode != 0:
        return result
    probe = (
        "import json, torch, bert_cluster._loader as l; s = l.load(); from bert_cluster import ops; "
        "print(json.dumps({'state': {k: s[k] for k in ('loaded', 'reason', 'with_cuda')}, "
        "'path': s.get('path'), 'cpu': [o for o in ops.OPS if l._has_kernel(o, 'CPU')], "
        "'cuda': [o for o in ops.OPS if l._has_kernel(o, 'CUDA')]}))"
    )
    check = subprocess.run([sys.executable, "-c", probe], cwd=_ROOT, env=env, capture_output=True, text=True)
    if check.returncode != 0:
        result["log"] += "\n" + check.stderr[-2000:]
        return result
    import json

    facts = json.loads(check.stdout.strip().splitlines()[-1])
    result.update(path=facts["path"], cpu_ops=facts["cpu"], cuda_ops=facts["cuda"])
    result["ok"] = facts["state"]["loaded"] and (not cuda or len(facts["cuda"]) == len(facts["cpu"]))
    if not facts["state"]["loaded"]:
        result["log"] += "\n" + facts["state"]["reason"]
    return result
