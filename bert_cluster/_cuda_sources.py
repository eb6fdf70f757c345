"""What the CUDA kernels are built from, for both builds: setup.py's ``--cuda`` one and the first-use JIT.

Standard library only, and no package import: setup.py loads this file by path, before the package (or
its dependencies) can be imported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: nvcc's flags (C++20 as the CPU kernels; ``-lineinfo`` so that profilers and compute-sanitizer name lines).
NVCC_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
#: The host compiler's flags (every kernel library, and the CUDA sources' host code).
CXX_FLAGS = ["-O3", "-std=c++20", "-fvisibility=hidden", "-Wno-psabi"]
#: The architectures a build makes when ``TORCH_CUDA_ARCH_LIST`` is unset (Ampere, Hopper, and PTX for
#: newer GPUs). The JIT builds for the GPUs it sees instead (torch's own default).
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"

_PACKAGE = Path(__file__).resolve().parent


def kernels_dir() -> Path | None:
    """The ``kernels`` folder: the source checkout's, else the copy a wheel carries in the package."""
    checkout = _PACKAGE.parent
    candidates = [_PACKAGE / "kernels"]
    if (checkout / "setup.py").is_file():  # not some other package's kernels/ beside us in site-packages
        candidates.insert(0, checkout / "kernels")
    for candidate in candidates:
        if (candidate / "cuda").is_dir() and (candidate / "checks.h").is_file():
            return candidate
    return None


def cuda_sources(kernels: Path) -> list[Path]:
    """The translation units of the CUDA kernels (``kernels/cuda/*.cu``), sorted."""
    return sorted((kernels / "cuda").glob("*.cu"))


def source_files(kernels: Path) -> list[Path]:
    """Every file the CUDA build reads from ``kernels`` (units and the headers they include)."""
    return [*cuda_sources(kernels), *sorted((kernels / "cuda").glob("*.cuh")), kernels / "checks.h"]


def sources_digest(kernels: Path) -> str:
    """A short hash of the CUDA build's source files and flags: a change builds anew."""
    digest = hashlib.sha256(repr((NVCC_FLAGS, CXX_FLAGS)).encode())
    for path in source_files(kernels):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cpu_sources(kernels: Path) -> list[Path]:
    """The translation units of the CPU kernels (``kernels/cpu/*.cpp``), sorted."""
    return sorted((kernels / "cpu").glob("*.cpp"))


def cpu_source_files(kernels: Path) -> list[Path]:
    """Every file the CPU kernels' build reads (a wheel carries them for the first-use build)."""
    return [*cpu_sources(kernels), *sorted((kernels / "cpu").glob("*.h")), kernels / "checks.h"]


def cpu_sources_digest(kernels: Path, flags: list[str]) -> str:
    """A short hash of the CPU kernels' source files and flags."""
    digest = hashlib.sha256(repr((CXX_FLAGS, flags)).encode())
    for path in cpu_source_files(kernels):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def include_dirs(torch_dir: Path) -> list[str]:
    """Extra include folders: pip's CUDA torch ships headers the system toolkit may lack (cusparse.h)."""
    return [str(path) for path in sorted(torch_dir.resolve().parent.glob("nvidia/cu*/include"))]
