"""The CUDA kernels built on first use, where the installed ``_C`` has none (a wheel, a CPU build).

The first time a CUDA tensor reaches the kernel backend and no CUDA kernel is registered, the sources
(``kernels/cuda``: the checkout's, or the copy a wheel carries) are compiled with torch's own extension
builder (nvcc from ``CUDA_HOME``) for the GPUs torch sees, or for ``$TORCH_CUDA_ARCH_LIST``, into the
user cache, and loaded: their ``TORCH_LIBRARY_IMPL`` blocks register the CUDA implementations of the op
schemas ``bert_cluster.ops`` defined. The folder is keyed by the torch build, CUDA release, architectures
and a hash of the sources, so a later process loads the library in about a second and an update builds
anew; torch's builder locks the folder, so processes starting together build it once. One attempt per
process: a failure is kept as the CUDA backend's reason and ``auto`` runs the reference.
``BERT_CLUSTER_CUDA_JIT=0`` turns it off; ``bert-cluster kernels build --cuda`` builds now.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bert_cluster import _cuda_sources, _loader, environment

_result: dict[str, Any] = {}  # filled by the first build() of this process


@functools.cache
def nvcc() -> str | None:
    """The nvcc torch's builder would use (``$CUDA_HOME/bin/nvcc``, else the one on PATH), or None."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def why_not() -> str:
    """Why this process cannot build the CUDA kernels ('' when it can)."""
    if not environment.cuda_jit_enabled():
        return f"{environment.CUDA_JIT}=0 turns the first-use CUDA build off"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    if _kernels() is None:
        return "this install carries no CUDA sources (kernels/cuda)"
    if nvcc() is None:
        return f"no nvcc found (set CUDA_HOME to a CUDA {torch.version.cuda} toolkit, torch's own release)"
    return ""


@functools.cache
def _kernels() -> Path | None:
    return _cuda_sources.kernels_dir()


def arch_list() -> str:
    """The architectures to build: ``$TORCH_CUDA_ARCH_LIST``, else those of the visible GPUs."""
    explicit = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if explicit:
        return explicit
    if not torch.cuda.is_available():
        return _cuda_sources.DEFAULT_ARCH_LIST
    found = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(found))


def build_dir() -> Path:
    """The cache folder of this torch build, CUDA release, architectures and sources."""
    kernels = _cuda_sources.kernels_dir()
    digest = _cuda_sources.sources_digest(kernels) if kernels else "none"
    arch = arch_list().replace(";", "_").replace(".", "").replace("+", "").replace(" ", "")
    torch_tag = str(torch.__version__).replace("+", "_")
    name = f"torch{torch_tag}-cuda{torch.version.cuda}-sm{arch}-{digest}"
    return environment.cache_dir() / "cuda-kernels" / name


def loaded() -> bool:
    """Whether ``build()`` left the CUDA kernels registered in this process (built, cached, or ``_C``'s)."""
    return bool(_result.get("ok"))


def attempted() -> dict[str, Any]:
    """What the first build of this process gave (empty before it): ``ok``, ``reason``, ``path``, ..."""
    return dict(_result)


def build(verbose: bool = False) -> dict[str, Any]:
    """Compile (or reuse the cached) CUDA kernel library and load it into torch; once per process.

    Returns:
        ``ok``, ``reason`` (why not, else ''), ``path`` of the library, ``arch_list``, ``seconds``.
    """
    if _result:
        return dict(_result)
    result: dict[str, Any] = {"ok": False, "reason": "", "path": None, "arch_list": None, "seconds": 0.0}
    reason = why_not()
    if reason:
        result["reason"] = reason
        _result.update(result)
        return dict(result)
    from torch.utils import cpp_extension

    from bert_cluster import ops

    state = ops.load_kernels()  # the schemas exist once ops is imported; the CPU libraries load as usual
    if state["loaded"] and state["with_cuda"]:  # a --cuda build: a second registration would fail
        result.update(ok=True, path=state.get("path"))
        _result.update(result)
        return dict(result)
    kernels = _cuda_sources.kernels_dir()
    assert kernels is not None  # why_not() said so
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    architectures = arch_list()
    result["arch_list"] = architectures
    start = time.perf_counter()
    if not any(folder.glob("*.so")):
        print(
            f"bert_cluster: building the CUDA kernels for {architectures} (first use: a few minutes; "
            f"cached in {folder})",
            file=sys.stderr,
            flush=True,
        )
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = architectures
    try:
        path = cpp_extension.load(
            name="bert_cluster_cuda",
            sources=[str(path) for path in _cuda_sources.cuda_sources(kernels)],
            extra_cflags=_cuda_sources.CXX_FLAGS,
            extra_cuda_cflags=_cuda_sources.NVCC_FLAGS,
            extra_include_paths=_cuda_sources.include_dirs(Path(torch.__file__).parent),
            build_directory=str(folder),
            with_cuda=True,
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError, SystemExit) as error:  # a failed compile raises RuntimeError
        log = folder / "build-error.log"
        log.write_text(str(error), encoding="utf-8")
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        result["reason"] = f"the first-use CUDA build failed ({first[:200]}); the compiler's output: {log}"
    else:
        result.update(ok=True, path=str(path))
        # The registrations changed: the loader's answer to "which ops lack a CUDA kernel" is stale.
        _loader.load().get("missing_kernels", {}).pop("CUDA", None)
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous
    result["seconds"] = round(time.perf_counter() - start, 1)
    _result.update(result)
    return dict(result)


def note() -> str:
    """What the CUDA backend's reason adds about the first-use build."""
    if _result:
        return "" if _result["ok"] else _result["reason"]
    reason = why_not()
    if reason:
        return f"no first-use CUDA build: {reason}"
    return "the CUDA kernels build on the first CUDA call (`bert-cluster kernels build --cuda`: now)"
