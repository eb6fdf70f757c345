"""Facts about the installed build and the build driver (``bert-cluster env`` / ``kernels build``).

Sits on top of the import chain ``environment`` <- ``_loader`` <- ``ops`` <- ``dispatch`` <- ``_build``:
nothing below imports it.

Several processes may build at once (two ``bert-cluster kernels build``, or a test run started twice):
one builds, under a file lock in the checkout's ``build/`` folder, and the others wait, then use the
build it finished. The libraries are built in a temporary folder and moved into the package with
``os.replace`` (setuptools' ``--inplace`` copy writes them in place, where a process loading them meanwhile
would read half a file, and one that had loaded the old file could crash on its rewritten pages).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import filelock
import torch

from bert_cluster import _loader, dispatch, environment, ops

_ROOT = Path(__file__).resolve().parent.parent  # the source checkout (setup.py lives here)
#: How long a build waits for another process's build to finish (a CUDA build takes up to ~20 minutes).
BUILD_LOCK_TIMEOUT_S = 3600.0


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
        "threads": environment.threads(),
        "parallel_backend": "OpenMP" if "OpenMP" in torch.__config__.parallel_info() else "native",
        "kernels_loaded": state["loaded"],
        "kernels_reason": state["reason"],
        "kernels_path": state.get("path"),
        "kernels_built_for_torch": state["torch_version"],
        "kernels_with_cuda": state["with_cuda"],
        "kernels_cpu_isa": state.get("cpu_isa"),
        "kernels_cpu_isas_built": state.get("cpu_isas") or [],
        "kernels_disabled_by_env": environment.kernels_disabled(),
        "backend_env": environment.backend_override(),
        "backends": dispatch.describe(),
        "auto_backend_cpu": auto_cpu,
    }


def build_kernels(
    cuda: bool = False, verbose: bool = False, lock_timeout_s: float = BUILD_LOCK_TIMEOUT_S
) -> dict[str, Any]:
    """Build ``bert_cluster._C`` and its CPU libraries into the source checkout's package folder.

    Runs ``setup.py build_ext`` in a subprocess, so a process that already loaded an older ``_C`` is
    unaffected; the libraries land in a temporary folder and replace the old ones atomically, and the new
    build is then imported in a fresh interpreter to say which ops it registered. One process builds at a
    time: a second waits (up to ``lock_timeout_s``) and, if the first finished the same build meanwhile,
    reports that build instead of making it again. ``cuda`` adds the CUDA kernels
    (``BERT_CLUSTER_BUILD_CUDA=1``; ``TORCH_CUDA_ARCH_LIST`` defaults to ``8.0;9.0+PTX``).

    Returns:
        ``ok``, ``cuda``, ``seconds``, ``path`` of the built module, ``cpu_ops`` / ``cuda_ops``
        registered, ``returncode``, ``built_by`` (the pid of the process that built) and ``log`` (the
        last lines of the build output, all of it with verbose).
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
        if cuda:  # an installed wheel: the first-use build, now (its CPU kernels came prebuilt)
            from bert_cluster import _cuda_jit

            built = _cuda_jit.build(verbose=verbose)
            registered = [op for op in ops.KERNEL_OPS if _loader.has_kernel(op, "CUDA")]
            result.update(ok=built["ok"], seconds=built["seconds"], path=built["path"], cuda_ops=registered)
            result["log"] = built["reason"] or f"built for {built['arch_list']} into {built['path']}"
            return result
        result["log"] = (
            f"no setup.py at {_ROOT}: this install's CPU kernels came prebuilt; rebuilding them needs a "
            "source checkout of bert-cluster (`--cuda` builds the CUDA kernels here)"
        )
        return result
    env = dict(os.environ)
    env.pop(environment.SKIP_KERNELS, None)
    env[environment.BUILD_CUDA] = "1" if cuda else "0"
    if cuda:
        env.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        if "CUDA_HOME" not in env and Path("/usr/local/cuda").is_dir():
            env["CUDA_HOME"] = "/usr/local/cuda"
    work = _ROOT / "build"
    stamp = work / "kernels-build.json"
    start = time.perf_counter()
    seen = _read_stamp(stamp)
    try:
        work.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(work / "kernels-build.lock", timeout=lock_timeout_s)
        lock.acquire()
    except filelock.Timeout:
        result["log"] = (
            f"another kernel build has held {work / 'kernels-build.lock'} for over {lock_timeout_s:.0f} s; "
            "run this again when it is done"
        )
        return result
    except OSError as error:
        result["log"] = f"cannot lock the build folder {work}: {error}"
        return result
    try:
        finished = _read_stamp(stamp)
        if finished != seen and finished.get("ok") and finished.get("cuda") == cuda:
            # another process finished this very build while this one waited: use it
            result.update(returncode=0, built_by=finished.get("pid"))
            result["log"] = f"built by process {finished.get('pid')} while this one waited for it"
        else:
            returncode, log = _build_and_install(setup_py, env, work)
            result.update(returncode=returncode, built_by=os.getpid())
            result["log"] = log if verbose else "\n".join(log.splitlines()[-20:])
            _write_stamp(
                stamp, {"ok": returncode == 0, "cuda": cuda, "pid": os.getpid(), "time": time.time()}
            )
    finally:
        lock.release()
    result["seconds"] = round(time.perf_counter() - start, 1)
    if result["returncode"] != 0:
        return result
    return _probe(result, env, cuda)


def _build_and_install(setup_py: Path, env: dict[str, str], work: Path) -> tuple[int, str]:
    """``setup.py build_ext`` into a temporary folder, then each library moved into place atomically."""
    with tempfile.TemporaryDirectory(prefix="kernels-", dir=work) as staging:
        proc = subprocess.run(
            [sys.executable, str(setup_py), "build_ext", "--build-lib", staging],
            cwd=_ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            return proc.returncode, log
        built = [path for path in Path(staging).rglob("*") if path.is_file()]
        if not built:
            return 1, log + f"\nthe build wrote no library into {staging}"
        # The CPU libraries first and _C last: a process that imports the new _C finds its libraries.
        for path in sorted(built, key=lambda p: p.name.startswith("_C.")):
            install_atomically(path, _ROOT / path.relative_to(staging))
    return 0, log


def install_atomically(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` so that a reader sees the old file or the new one, never half of one.

    The copy goes to a temporary name in the target's folder (the same filesystem), then ``os.replace``
    swaps it in: a process that mapped the old library keeps its (now unnamed) file intact.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copy2(source, temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _read_stamp(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_stamp(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(data))
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def _probe(result: dict[str, Any], env: dict[str, str], cuda: bool) -> dict[str, Any]:
    """Import the build in a fresh interpreter: the ops it registered; ``ok`` when they are all there."""
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
