"""Builds ``kernels/`` into ``bert_cluster._C``; all packaging metadata lives in pyproject.toml.

Environment:
    BERT_CLUSTER_SKIP_KERNELS=1   build no extension (the library then runs on the reference).
    BERT_CLUSTER_BUILD_CUDA=1     add the CUDA kernels (nvcc from CUDA_HOME; no GPU needed at build
                                  time; set TORCH_CUDA_ARCH_LIST, e.g. "9.0", else 8.0;9.0+PTX).
    BERT_CLUSTER_NATIVE=1         compile the CPU code with -march=native only (not portable).
    BERT_CLUSTER_MARCH=ARCH       compile the CPU code for one ISA only, e.g. x86-64-v3.
    BERT_CLUSTER_ONLY_THIS_CPU=1  build only the CPU library of this CPU's x86-64 level (the demo's install).
    BERT_CLUSTER_KERNEL_CACHE=DIR reuse a library built before from the same inputs (every file under
                                  kernels/, the extension's flags and macros, torch's release, the
                                  compiler's version, Python's ABI tag), and store each one built: CI
                                  builds the same three CPU libraries twice (the editable install, then
                                  tests/test_wheel.py's wheel from its sdist), 3 to 4 minutes of compiling.

The CPU kernels are compiled once per x86-64 ISA level into their own libraries
(``bert_cluster._C_cpu_x86_64_v4`` = AVX-512, ``_v3`` = AVX2 + FMA, ``_C_cpu_x86_64`` = SSE2), of which
``bert_cluster._loader`` loads the best the CPU runs (``BERT_CLUSTER_CPU_ISA`` picks a lower one);
``bert_cluster._C`` carries the facts of the build and, when built with CUDA, the CUDA kernels.

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already installed;
an editable install keeps its object files in ``build/editable`` (pip's own temporary folder is new each
time), so reinstalling recompiles only the kernel sources that changed.

Wheels (``python -m build``: an sdist, then a wheel built from it, with the pinned torch of
``[build-system]`` in an isolated environment; ``MANIFEST.in`` lists what the sdist carries): the CPU
libraries, the kernel sources and ``configs/`` are inside the wheel, which requires a torch range: the
prebuilt CPU libraries serve the release they were built with, other releases build them on first use.
A CUDA wheel: ``BERT_CLUSTER_BUILD_CUDA=1 python -m build --wheel --no-isolation`` in an environment with a
CUDA build of the torch release and a matching nvcc (an isolated build would install the CPU torch of
``[build-system]``; for another torch release change its pin in pyproject.toml first).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_cuda_sources():
    """bert_cluster/_cuda_sources.py, loaded by path (the package's imports need what a build lacks)."""
    spec = importlib.util.spec_from_file_location("_cuda_sources", ROOT / "bert_cluster" / "_cuda_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: What the CUDA kernels are built from and with: shared with the first-use build (bert_cluster._cuda_jit).
CUDA = _load_cuda_sources()


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0", "false", "False")


def _extensions() -> tuple[list, dict]:
    if _flag("BERT_CLUSTER_SKIP_KERNELS"):
        print("bert-cluster: BERT_CLUSTER_SKIP_KERNELS set, building no kernels", file=sys.stderr)
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    _check_torch_pin(str(torch.__version__))
    cuda = _flag("BERT_CLUSTER_BUILD_CUDA")
    cpu_sources = sorted(glob.glob("kernels/cpu/*.cpp"))
    version = str(torch.__version__)
    macros = [
        ("BERT_CLUSTER_TORCH_VERSION", f'"{version}"'),
        ("BERT_CLUSTER_WITH_CUDA", "1" if cuda else "0"),
    ]
    # The limited API keeps one _C.abi3.so valid across Python versions (module.cpp needs no more).
    macros.append(("Py_LIMITED_API", "0x030A0000"))
    cxx = list(CUDA.CXX_FLAGS)
    libraries = _cpu_libraries()
    # Python's CFLAGS ask for -g: three CPU libraries' debug information made the build slow and each
    # library 16 MB; symbols stay (profilers name the functions).
    kernels = [
        CppExtension(
            name=f"bert_cluster._C_cpu_{label}",
            sources=cpu_sources,
            define_macros=macros,
            extra_compile_args={"cxx": [*cxx, *flags, "-g0"]},
            py_limited_api=True,
        )
        for label, flags, _level in libraries
    ]
    listing = ",".join(f"{label}:{level}" for label, _flags, level in libraries)
    module_macros = macros + [("BERT_CLUSTER_CPU_LIBS", f'"{listing}"')]
    kwargs = dict(name="bert_cluster._C", define_macros=module_macros, py_limited_api=True)
    if not cuda:
        module = CppExtension(sources=["kernels/module.cpp"], extra_compile_args={"cxx": cxx}, **kwargs)
        return [module, *kernels], {"build_ext": _build_ext_class(BuildExtension)}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", CUDA.DEFAULT_ARCH_LIST)
    sources_dir = ROOT / "kernels"
    module = CUDAExtension(
        sources=["kernels/module.cpp", *(str(p.relative_to(ROOT)) for p in CUDA.cuda_sources(sources_dir))],
        include_dirs=CUDA.include_dirs(Path(torch.__file__).parent),
        extra_compile_args={"cxx": cxx, "nvcc": CUDA.NVCC_FLAGS},
        **kwargs,
    )
    return [module, *kernels], {"build_ext": _build_ext_class(BuildExtension)}


def _check_torch_pin(built_for: str) -> None:
    """Say so when the torch building the kernels is outside the range the package requires.

    A wheel's prebuilt CPU kernels serve the torch release they were built against; under another release
    of the range they build on first use (bert_cluster/_cpu_jit.py). A torch outside the range would
    make a wheel whose own kernels never load.
    """
    import re

    match = re.search(r'^\s*"torch>=([\d.]+),<([\d.]+)",', (ROOT / "pyproject.toml").read_text(), re.M)
    if not match:
        return
    release = tuple(int(part) for part in re.findall(r"\d+", built_for.split("+")[0])[:2])
    low, high = (tuple(int(part) for part in bound.split(".")[:2]) for bound in match.groups())
    if not low <= release < high:
        print(
            f"bert-cluster: NOTE the kernels are built against torch {built_for}, outside pyproject.toml's "
            f"torch>={match.group(1)},<{match.group(2)}: a wheel of this build would not load its kernels",
            file=sys.stderr,
        )


def _build_ext_class(base: type) -> type:
    """Torch's BuildExtension with a temporary folder per extension.

    The CPU libraries compile the same sources with different flags: in one folder their object files
    overwrote each other, and every build recompiled all of them.
    """

    class BuildExtensionPerFolder(base):
        def build_extension(self, ext) -> None:  # noqa: D102 - setuptools' command protocol
            cache = os.environ.get("BERT_CLUSTER_KERNEL_CACHE", "").strip()
            output = Path(self.get_ext_fullpath(ext.name))
            stored = Path(cache) / f"{ext.name}-{_cache_key(ext, self.compiler)}.so" if cache else None
            if stored is not None and stored.is_file():
                output.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(stored, output)
                os.utime(stored)  # recently used: kept by _prune
                print(f"bert-cluster: {ext.name} from the kernel cache ({stored.name})", file=sys.stderr)
                return
            shared = self.build_temp
            # pip's editable install builds in a new temporary folder each time: keep its objects in the
            # checkout instead, so that ninja recompiles only what changed.
            root = ROOT / "build" / "editable" if getattr(self, "editable_mode", False) else shared
            self.build_temp = os.path.join(root, ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared
            if stored is not None:  # written whole, then renamed: a reader never sees half a library
                stored.parent.mkdir(parents=True, exist_ok=True)
                partial = stored.with_name(f"{stored.name}.{os.getpid()}.partial")
                shutil.copyfile(output, partial)
                os.replace(partial, stored)
                _prune(stored.parent, ext.name)

    return BuildExtensionPerFolder


def _prune(cache: Path, name: str, keep: int = 2) -> None:
    """Keep the ``keep`` most recently used libraries of extension ``name`` in the cache (about 1 MB each)."""
    entries = sorted(cache.glob(f"{name}-*.so"), key=lambda path: path.stat().st_mtime, reverse=True)
    for path in entries[keep:]:
        path.unlink(missing_ok=True)


def _cache_key(ext, compiler) -> str:
    """What a kernel library is built from, hashed: equal keys build the same library (``KERNEL_CACHE``).

    Every file under kernels/ (a file missing from an sdist changes the key, so that build compiles and
    fails as it would without the cache), the extension's flags, macros and libraries (not its include
    folders: the torch headers' absolute paths differ between environments of the same release), torch's
    release and commit, the compiler's version and Python's ABI tag.
    """
    import hashlib
    import subprocess
    import sysconfig

    import torch

    digest = hashlib.sha256()
    kernels = ROOT / "kernels"
    for path in sorted(p for p in kernels.rglob("*") if p.is_file()):
        digest.update(path.relative_to(kernels).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    command = list(getattr(compiler, "compiler_so", None) or ["c++"])
    try:
        version = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = "unknown"
    facts = (
        ext.name,
        list(ext.sources),  # relative to the root (setup.py names them so)
        ext.extra_compile_args,
        ext.define_macros,
        ext.undef_macros,
        ext.libraries,
        ext.extra_link_args,
        ext.py_limited_api,
        command[1:],
        version,
        str(torch.__version__),
        torch.version.git_version,
        sysconfig.get_config_var("SOABI"),
        sysconfig.get_config_var("CFLAGS"),
        platform.machine(),
    )
    digest.update(repr(facts).encode())
    return digest.hexdigest()[:24]


def _cpu_libraries() -> list[tuple[str, list[str], int]]:
    """(label, compiler flags, x86-64 level the CPU needs; 0: any) of each CPU kernel library, best first.

    The kernels' 64-byte vectors (kernels/cpu/simd.h) are one register with AVX-512 and a struct of two or
    four registers below it; GCC compiles each only for one ISA at a time, hence one library per level.
    """
    march = os.environ.get("BERT_CLUSTER_MARCH", "").strip()
    if not march and _flag("BERT_CLUSTER_NATIVE"):
        march = "native"
    if march:
        return [(march.replace("-", "_"), [f"-march={march}"], 0)]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [("generic", [], 0)]
    # GCC's generic tuning folds every reuse of a loaded vector into a memory-operand FMA (three times the
    # loads in the hashing and refinement loops: 25-50% slower on an AVX-512 Xeon, measured); Intel tuning
    # keeps it in a register. Tuning only: each library runs on every CPU of its level.
    tune = ["-mtune=skylake-avx512"]
    libraries = [
        ("x86_64_v4", ["-march=x86-64-v4", *tune], 4),
        ("x86_64_v3", ["-march=x86-64-v3", *tune], 3),
        ("x86_64", ["-march=x86-64", *tune], 1),
    ]
    if _flag("BERT_CLUSTER_ONLY_THIS_CPU"):
        level = _this_cpu_level()
        if level:
            return [next(library for library in libraries if library[2] <= level)]
    return libraries


#: The CPU flags each x86-64 level adds to the one below (/proc/cpuinfo's names; lzcnt is "abm").
_LEVEL_FLAGS = {
    3: {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    4: {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def _this_cpu_level() -> int:
    """The x86-64 level of the building CPU, from /proc/cpuinfo (module.cpp tells it at run time); 0: unknown.

    For BERT_CLUSTER_ONLY_THIS_CPU=1 (the demo's install): the one library this machine loads, a third of
    the compile; such a build does not run on a CPU of a lower level.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 0
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if not flags:
        return 0
    level = 1
    for candidate in (3, 4):
        if not _LEVEL_FLAGS[candidate] <= flags:
            break
        level = candidate
    return level


class BuildPyWithConfigs(build_py):
    """Ship ``configs/`` and the CUDA sources inside the package (``bert_cluster/configs``, ``/kernels``).

    A wheel's CUDA kernels build on first use from that copy (``bert_cluster._cuda_jit``). An editable
    install reads both from the checkout instead (``evaluation.tasks.config_root``, ``_cuda_sources``).
    """

    def run(self) -> None:  # noqa: D102 - setuptools' command protocol
        super().run()
        if not getattr(self, "editable_mode", False):
            package = Path(self.build_lib) / "bert_cluster"
            shutil.copytree(ROOT / "configs", package / "configs", dirs_exist_ok=True)
            kernels = ROOT / "kernels"
            for path in [*CUDA.source_files(kernels), *CUDA.cpu_source_files(kernels)]:
                target = package / "kernels" / path.relative_to(kernels)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithConfigs
options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
