"""Facts about the installed build and the build driver (``bert-cluster env`` / ``kernels build``).

Sits on top of the import chain ``_loader`` <- ``ops`` <- ``dispatch`` <- ``_build``: nothing below
imports it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bert_cluster import dispatch, ops

_ROOT = Path(__file__).resolve().parent.parent  # the source checkout (setup.py lives here)


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
    state = ops.load_kernels()
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
        "kernels_cpu_isa": state.get("cpu_isa"),
        "kernels_cpu_isas_built": state.get("cpu_isas") or [],
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
        "import json; from bert_cluster import _loader, ops; s = ops.load_kernels(); "
        "print(json.dumps({'state': {k: s[k] for k in ('loaded', 'reason', 'with_cuda')}, "
        "'path': s.get('path'), 'cpu_isa': s.get('cpu_isa'), "
        "'cpu': [o for o in ops.OPS if _loader.has_kernel(o, 'CPU')], "
        "'cuda': [o for o in ops.OPS if _loader.has_kernel(o, 'CUDA')]}))"
    )
    check = subprocess.run([sys.executable, "-c", probe], cwd=_ROOT, env=env, capture_output=True, text=True)
    if check.returncode != 0:
        result["log"] += "\n" + check.stderr[-2000:]
        return result
    facts = json.loads(check.stdout.strip().splitlines()[-1])
    result.update(path=facts["path"], cpu_isa=facts["cpu_isa"], cpu_ops=facts["cpu"], cuda_ops=facts["cuda"])
    required = set(ops.KERNEL_OPS)
    complete = required <= set(facts["cpu"]) and (not cuda or required <= set(facts["cuda"]))
    result["ok"] = facts["state"]["loaded"] and complete
    if not facts["state"]["loaded"]:
        result["log"] += "\n" + facts["state"]["reason"]
    return result
