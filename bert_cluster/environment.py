"""Every ``BERT_CLUSTER_*`` environment variable and every fact about the machine, in one place.

The variables are read when asked, not at import: tests and users change them between calls, and one
read costs about a microsecond. Each has one name, one meaning (``VARIABLES``) and one parser here.
The facts (CPU name, package versions, threads, GPU) are what ``bert-cluster env``, results.json, the
crossover cache key and the benchmarks record about where they ran. The kernels' own facts (their ISA,
the compiler) come from the build itself, through ``bert_cluster.ops.load_kernels()``.

This module imports nothing from the package (nor torch) at import time, so every module may import it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Forces the backend of ``backend="auto"``: auto, cuda, cpu or reference.
BACKEND = "BERT_CLUSTER_BACKEND"
#: Set (not "0"): never use the compiled kernels; the PyTorch reference runs, without a warning.
DISABLE_KERNELS = "BERT_CLUSTER_DISABLE_KERNELS"
#: Names the CPU kernel library to load (``x86_64_v3``, or ``x86-64-v3``) instead of the best one.
CPU_ISA = "BERT_CLUSTER_CPU_ISA"
#: ``0``: never build the CUDA kernels on first use (where ``_C`` has none and nvcc exists).
CUDA_JIT = "BERT_CLUSTER_CUDA_JIT"
#: ``0``: never build the CPU kernels on first use (where the prebuilt ones are for another torch release).
CPU_JIT = "BERT_CLUSTER_CPU_JIT"
#: The folder of the crossover cache (else ``$XDG_CACHE_HOME/bert-cluster``, else ``~/.cache/bert-cluster``).
CACHE_DIR = "BERT_CLUSTER_CACHE_DIR"
#: Extra data folders of the evaluator, separated by ``os.pathsep``.
DATA_DIR = "BERT_CLUSTER_DATA_DIR"
#: The evaluator's ``configs`` folder (tasks, default run).
CONFIGS = "BERT_CLUSTER_CONFIGS"
#: The ``shared`` folder of checkpoints and data that the tests and benchmarks use.
SHARED = "BERT_CLUSTER_SHARED"

#: Set by ``bert-cluster serve --workers N`` for its worker processes (not a user setting): the served
#: settings as JSON, and N.
SERVE_SETTINGS = "BERT_CLUSTER_SERVE_SETTINGS"
SERVE_WORKERS = "BERT_CLUSTER_SERVE_WORKERS"

#: Read by ``setup.py`` at build time (it runs before the package exists, so it parses them itself).
SKIP_KERNELS = "BERT_CLUSTER_SKIP_KERNELS"
BUILD_CUDA = "BERT_CLUSTER_BUILD_CUDA"
NATIVE = "BERT_CLUSTER_NATIVE"
MARCH = "BERT_CLUSTER_MARCH"
ONLY_THIS_CPU = "BERT_CLUSTER_ONLY_THIS_CPU"

#: name -> meaning, for documentation and ``bert-cluster env``.
VARIABLES: dict[str, str] = {
    BACKEND: "the backend of backend='auto': auto, cuda, cpu or reference",
    DISABLE_KERNELS: "set (not 0): the PyTorch reference runs instead of the compiled kernels",
    CPU_ISA: "the CPU kernel library to load (x86_64_v3, ...) instead of the best this CPU runs",
    CUDA_JIT: "0: never build the CUDA kernels on first use (they build where _C has none and nvcc exists)",
    CPU_JIT: "0: never build the CPU kernels on first use (they build where the prebuilt ones are for "
    "another torch release)",
    CACHE_DIR: "folder of the min_length='auto' crossover cache and the first-use CUDA and CPU kernels",
    DATA_DIR: "extra data folders of the evaluator (os.pathsep-separated)",
    CONFIGS: "the evaluator's configs folder",
    SHARED: "the shared checkpoints and data of the tests and benchmarks",
    SKIP_KERNELS: "build time: build no kernels",
    BUILD_CUDA: "build time: build the CUDA kernels too",
    NATIVE: "build time: compile the CPU kernels with -march=native only",
    MARCH: "build time: compile the CPU kernels for this one ISA",
    ONLY_THIS_CPU: "build time: only the CPU kernel library of this CPU's x86-64 level (the demo's install)",
}


def _text(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def is_set(name: str) -> bool:
    """A flag variable: set to anything but empty or ``0``."""
    return os.environ.get(name, "") not in ("", "0")


def kernels_disabled() -> bool:
    """``$BERT_CLUSTER_DISABLE_KERNELS``: the reference runs instead of the kernels."""
    return is_set(DISABLE_KERNELS)


def backend_override() -> str | None:
    """``$BERT_CLUSTER_BACKEND``, unchecked (``dispatch`` says what is allowed); None when unset."""
    return _text(BACKEND)


def backend_key() -> tuple[str | None, str | None]:
    """The raw values of the variables the backend choice reads: a cache key, read on every call."""
    environ = os.environ
    return environ.get(BACKEND), environ.get(DISABLE_KERNELS)


def cuda_jit_enabled() -> bool:
    """``$BERT_CLUSTER_CUDA_JIT`` is not ``0``: the CUDA kernels may build on first use."""
    return os.environ.get(CUDA_JIT, "").strip() not in ("0", "false", "False", "no")


def cpu_jit_enabled() -> bool:
    """``$BERT_CLUSTER_CPU_JIT`` is not ``0``: the CPU kernels may build on first use."""
    return os.environ.get(CPU_JIT, "").strip() not in ("0", "false", "False", "no")


def cpu_isa_override() -> str | None:
    """``$BERT_CLUSTER_CPU_ISA``; None when unset."""
    return _text(CPU_ISA)


def serve_settings() -> str | None:
    """``$BERT_CLUSTER_SERVE_SETTINGS``: the settings a ``serve --workers`` process serves (JSON)."""
    return _text(SERVE_SETTINGS)


def serve_workers() -> int:
    """``$BERT_CLUSTER_SERVE_WORKERS``: how many worker processes ``serve`` started (1 when unset)."""
    return int(_text(SERVE_WORKERS) or 1)


def cache_dir() -> Path:
    """The user cache folder of bert-cluster (the crossover figures, the first-use CUDA kernels)."""
    explicit = _text(CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bert-cluster"


def data_dirs() -> list[Path]:
    """``$BERT_CLUSTER_DATA_DIR``'s folders, in order."""
    value = os.environ.get(DATA_DIR, "")
    return [Path(part).expanduser() for part in value.split(os.pathsep) if part]


def configs_dir() -> Path | None:
    """``$BERT_CLUSTER_CONFIGS``; None when unset."""
    value = _text(CONFIGS)
    return Path(value).expanduser() if value else None


def shared_dir(default: Path) -> Path:
    """``$BERT_CLUSTER_SHARED``, else ``default``."""
    value = _text(SHARED)
    return Path(value).expanduser() if value else default


# --- facts ---------------------------------------------------------------------------------------------


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def device_name(device: torch.device | str) -> str:
    """The model of a device: the GPU's name, or the CPU's."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def gpu_name(device: torch.device | str = "cuda") -> str | None:
    """The GPU's name, or None where torch sees no GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device))


def threads() -> int:
    """The intra-op threads torch runs with."""
    import torch

    return torch.get_num_threads()


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution (``transformers``, ...), or None if not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def bert_cluster_version() -> str:
    """``bert_cluster.__version__`` (read when asked: the package has finished importing by then)."""
    from bert_cluster._version import __version__

    return __version__


def facts() -> dict[str, object]:
    """Where a measurement ran: versions, CPU, threads, GPU (what the benchmarks record)."""
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "bert_cluster": bert_cluster_version(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu_name(),
    }
