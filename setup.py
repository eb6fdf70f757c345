"""Builds ``kernels/`` into ``bert_cluster._C``; all packaging metadata lives in pyproject.toml.

Environment:
    BERT_CLUSTER_SKIP_KERNELS=1   build no extension (the library then runs on the reference).
    BERT_CLUSTER_BUILD_CUDA=1     add the CUDA kernels (nvcc from CUDA_HOME; no GPU needed at build
                                  time; set TORCH_CUDA_ARCH_LIST, e.g. "9.0", else 8.0;9.0+PTX).
    BERT_CLUSTER_NATIVE=1         compile the CPU code with -march=native (not portable).
    BERT_CLUSTER_MARCH=ARCH       compile the CPU code for one ISA only, e.g. x86-64-v3 or x86-64 (to test
                                  each of the ISA clones a portable build carries on one machine).

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already installed.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0", "false", "False")


def _extensions() -> tuple[list, dict]:
    if _flag("BERT_CLUSTER_SKIP_KERNELS"):
        print("bert-cluster: BERT_CLUSTER_SKIP_KERNELS set, building no kernels", file=sys.stderr)
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cuda = _flag("BERT_CLUSTER_BUILD_CUDA")
    cpu_sources = sorted(glob.glob("kernels/cpu/*.cpp")) + ["kernels/module.cpp"]
    version = str(torch.__version__)
    macros = [
        ("BERT_CLUSTER_TORCH_VERSION", f'"{version}"'),
        ("BERT_CLUSTER_WITH_CUDA", "1" if cuda else "0"),
    ]
    # The limited API keeps one _C.abi3.so valid across Python versions (module.cpp needs no more).
    macros.append(("Py_LIMITED_API", "0x030A0000"))
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-Wno-psabi"]
    march = os.environ.get("BERT_CLUSTER_MARCH", "").strip()
    if not march and _flag("BERT_CLUSTER_NATIVE"):
        march = "native"
    if march:
        cxx += [f"-march={march}", "-DBERT_CLUSTER_NO_MULTIVERSION"]
    else:
        # GCC's generic tuning folds every reuse of a loaded vector into a memory-operand FMA (three times
        # the loads in the hashing and refinement loops: 25-50% slower on an AVX-512 Xeon, measured); Intel
        # tuning keeps it in a register. Tuning only: every ISA clone still runs on every x86-64 CPU.
        cxx += ["-mtune=skylake-avx512"]
    kwargs = dict(name="bert_cluster._C", define_macros=macros, py_limited_api=True)
    if not cuda:
        ext = CppExtension(sources=cpu_sources, extra_compile_args={"cxx": cxx}, **kwargs)
        return [ext], {"build_ext": BuildExtension}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    include_dirs = []
    # pip's CUDA torch ships the headers the system toolkit may lack (cusparse.h) under nvidia/cu13.
    for candidate in sorted(Path(torch.__file__).resolve().parent.parent.glob("nvidia/cu*/include")):
        include_dirs.append(str(candidate))
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    ext = CUDAExtension(
        sources=cpu_sources + sorted(glob.glob("kernels/cuda/*.cu")),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        **kwargs,
    )
    return [ext], {"build_ext": BuildExtension}


class BuildPyWithConfigs(build_py):
    """Ship the repository's top-level ``configs/`` inside the package (``bert_cluster/configs``) in wheels.

    An editable install reads them from the checkout instead (``evaluation.tasks.config_root``).
    """

    def run(self) -> None:  # noqa: D102 - setuptools' command protocol
        super().run()
        if not getattr(self, "editable_mode", False):
            shutil.copytree(
                ROOT / "configs", Path(self.build_lib) / "bert_cluster" / "configs", dirs_exist_ok=True
            )


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithConfigs
options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
