"""The CPU kernels built on first use, where the prebuilt ones are for another torch release.

A wheel's CPU libraries link the libtorch they were built against; beside another torch release (the
package requires a range, so that installing it keeps the user's torch) they cannot load. Then the CPU
sources the wheel carries (``bert_cluster/kernels/cpu``, or the checkout's) are compiled once with
torch's extension builder, for this CPU's x86-64 level, into the user cache keyed by the torch build,
the level and a hash of the sources and flags, and loaded. Many processes may start at once: a file lock
beside the cache folder lets one build and the others wait, then load its library. A failure is kept as
the reason (``bert-cluster env`` shows it) and the reference runs. ``BERT_CLUSTER_CPU_JIT=0`` turns it
off. Imports only ``environment`` and ``_cuda_sources`` (``_loader`` calls it lazily).
"""

from __future__ import annotations

import contextlib
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bert_cluster import _cuda_sources, environment

#: How long a process waits for another one's build (one CPU library: ~3 min on 2 cores).
LOCK_TIMEOUT_S = 1800.0
#: x86-64 level -> (label, flags), as setup.py's libraries (the same tuning).
_LEVELS = {
    4: ("x86_64_v4", ["-march=x86-64-v4", "-mtune=skylake-avx512"]),
    3: ("x86_64_v3", ["-march=x86-64-v3", "-mtune=skylake-avx512"]),
    1: ("x86_64", ["-march=x86-64", "-mtune=skylake-avx512"]),
}
_LEVEL_FLAGS = {
    3: {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    4: {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def cpu_level() -> int:
    """This CPU's x86-64 level from /proc/cpuinfo (1 when unknown; 0 on another architecture)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 0
    flags, level = environment.cpu_flags(), 1
    for candidate in (3, 4):
        if not _LEVEL_FLAGS[candidate] <= flags:
            break
        level = candidate
    return level


def library_choice() -> tuple[str, list[str]]:
    """(label, compiler flags) of the library to build for this CPU."""
    level = cpu_level()
    return _LEVELS.get(level, ("generic", []))


def why_not() -> str:
    """Why this process cannot build the CPU kernels ('' when it can)."""
    if not environment.cpu_jit_enabled():
        return f"{environment.CPU_JIT}=0 turns the first-use CPU build off"
    kernels = _cuda_sources.kernels_dir()
    if kernels is None or not _cuda_sources.cpu_sources(kernels):
        return "this install carries no CPU kernel sources (kernels/cpu)"
    return ""


def build_dir(label: str, flags: list[str]) -> Path:
    """The cache folder of this torch build, CPU library and sources."""
    kernels = _cuda_sources.kernels_dir()
    digest = _cuda_sources.cpu_sources_digest(kernels, flags) if kernels else "none"
    torch_tag = str(torch.__version__).replace("+", "_")
    return environment.cache_dir() / "cpu-kernels" / f"torch{torch_tag}-{label}-{digest}"


def build(verbose: bool = False) -> dict[str, Any]:
    """Compile (or load the cached) CPU kernel library for this torch and load it into torch.

    Returns:
        ``ok``, ``reason`` (why not, else ''), ``path`` of the library, ``label``, ``seconds``.
    """
    result: dict[str, Any] = {"ok": False, "reason": "", "path": None, "label": None, "seconds": 0.0}
    reason = why_not()
    if reason:
        result["reason"] = reason
        return result
    import filelock
    from torch.utils import cpp_extension

    kernels = _cuda_sources.kernels_dir()
    assert kernels is not None  # why_not() said so
    label, flags = library_choice()
    folder = build_dir(label, flags)
    result["label"] = label
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(folder) + ".lock", timeout=LOCK_TIMEOUT_S):
            if not any(folder.glob("*.so")):
                print(
                    f"bert_cluster: building the CPU kernels for torch {torch.__version__} ({label}; first "
                    f"use: a few minutes; cached in {folder})",
                    file=sys.stderr,
                    flush=True,
                )
            path = cpp_extension.load(
                name=f"bert_cluster_cpu_{label}",
                sources=[str(path) for path in _cuda_sources.cpu_sources(kernels)],
                extra_cflags=[*_cuda_sources.CXX_FLAGS, *flags, "-g0"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=verbose,
            )
    except filelock.Timeout:
        result["reason"] = f"another process has held {folder}.lock for over {LOCK_TIMEOUT_S:.0f} s"
    except (RuntimeError, OSError, ImportError, SystemExit) as error:  # a failed compile: RuntimeError
        log = folder / "build-error.log"
        with contextlib.suppress(OSError):
            log.write_text(str(error), encoding="utf-8")
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        result["reason"] = f"the first-use CPU build failed ({first[:200]}); the compiler's output: {log}"
    else:
        result.update(ok=True, path=str(path) if path else str(next(folder.glob("*.so"), folder)))
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result
