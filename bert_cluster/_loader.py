"""Guarded import of the compiled kernels and why it failed: nothing else.

The build (setup.py) makes ``bert_cluster._C``, which carries its facts and, when built with CUDA, the
CUDA kernels, and one CPU kernel library per x86-64 ISA level (``_C_cpu_x86_64_v4`` with AVX-512,
``_C_cpu_x86_64_v3`` with AVX2 + FMA, ``_C_cpu_x86_64``); ``load()`` imports ``_C`` and loads the best
CPU library this CPU runs, or the one ``$BERT_CLUSTER_CPU_ISA`` names (a lower level: to measure or test
another ISA's kernels on one machine). All of them give the same results.

Nothing here runs at ``import bert_cluster``, and this module imports nothing from the package but
``environment`` (so it sits below ``ops``, ``dispatch`` and ``_build`` with no import circle).
``bert_cluster.ops.load_kernels`` calls ``load()`` once the op schemas exist; the libraries'
``TORCH_LIBRARY_IMPL`` blocks then register the CPU and CUDA implementations. A failure (absent, built
for another torch, another import error) is stored, reported once as a ``RuntimeWarning``, and the
library runs on the reference.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bert_cluster import environment

BUILD_HINT = "build it with `pip install --no-build-isolation -e .` or `bert-cluster kernels build`"

#: Names the built CPU kernel library (``x86_64_v3``, or ``x86-64-v3``, ...) to load instead of the best.
ISA_ENV = environment.CPU_ISA

_state: dict[str, Any] | None = None  # filled by load(); read by everything else
_cpu_library: list[str] = []  # the CPU kernel library this process loaded (torch cannot unload one)
_warned = False


def load(first_use: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Import ``bert_cluster._C`` once and return what happened.

    ``first_use`` (``ops`` passes ``_cpu_jit.build``) builds the CPU kernels for this torch when the
    prebuilt ones are for another release; without it such a build is only reported.

    Returns:
        ``loaded`` (bool), ``reason`` (why not, empty when loaded) and the facts the build carries:
        ``torch_version`` it was built for, ``with_cuda``, ``compiler``, ``path``.
    """
    global _state
    if _state is not None:
        return _state
    state: dict[str, Any] = {
        "loaded": False,
        "reason": "",
        "torch_version": None,
        "with_cuda": False,
        "cpu_isa": None,
        "cpu_isas": [],
        "cpu_library": None,
        "cpu_level": 0,
    }
    try:
        module = importlib.import_module("bert_cluster._C")
    except ModuleNotFoundError as error:
        if error.name not in ("bert_cluster._C", "bert_cluster"):
            state["reason"] = f"import error: {error}"
        else:
            state["reason"] = f"absent: bert_cluster._C is not built ({BUILD_HINT})"
    except ImportError as error:  # e.g. undefined symbol: compiled against another libtorch
        text = str(error)
        if "undefined symbol" in text or "version" in text.lower():
            state["reason"] = (
                f"built for another torch (running {torch.__version__}): {text}; rebuild: {BUILD_HINT}"
            )
            _build_on_first_use(state, first_use)
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
        if not compatible_torch(built_for, str(torch.__version__), state["with_cuda"]):
            state["reason"] = (
                f"built for another torch ({built_for}, running {torch.__version__}); rebuild: {BUILD_HINT}"
            )
            _build_on_first_use(state, first_use)
        else:
            state["reason"] = _load_cpu_library(module, state)
            state["loaded"] = not state["reason"]
    _state = state
    if not state["loaded"]:
        _warn_once(state["reason"])
    return state


def _build_on_first_use(state: dict[str, Any], first_use: Callable[[], dict[str, Any]] | None) -> None:
    """The prebuilt kernels are for another torch release: build the CPU ones for this torch (cached).

    On success the state says loaded, with this torch as the build's; else the reason names both failures.
    """
    if first_use is None or environment.kernels_disabled() or _cpu_library:
        return
    built = first_use()
    if not built["ok"]:
        state["reason"] += f"; {built['reason']}"
        return
    _cpu_library[:] = [built["path"]]
    state.update(
        loaded=True,
        reason="",
        torch_version=str(torch.__version__),
        with_cuda=False,
        path=built["path"],
        cpu_isa=built["label"],
        cpu_isas=[built["label"]],
        cpu_library=built["path"],
        built_on_first_use=True,
    )


def compatible_torch(built_for: str, running: str, with_cuda: bool) -> bool:
    """Whether kernels built against torch ``built_for`` load into torch ``running``.

    The C++ API is the release's, whichever accelerator a torch build carries: CPU kernels built against
    ``2.13.0+cpu`` serve ``2.13.0`` (PyPI's CUDA build) and ``2.13.0+cu130`` alike. A build with CUDA
    kernels links that CUDA build's libraries, so it needs the very same torch.
    """
    if built_for == running:
        return True
    return not with_cuda and built_for.split("+")[0] == running.split("+")[0]


def cpu_libraries(module: Any) -> list[tuple[str, int]]:
    """(label, x86-64 level it needs; 0: any CPU) of each CPU kernel library the build made, best first."""
    listing = str(getattr(module, "CPU_LIBS", "") or "")
    libraries = []
    for item in filter(None, listing.split(",")):
        label, _, level = item.partition(":")
        libraries.append((label, int(level or 0)))
    return libraries


def choose_cpu_library(libraries: list[tuple[str, int]], cpu_level: int, requested: str | None) -> str:
    """The label of the best library the CPU runs, or of ``requested`` (refused if the CPU lacks its ISA).

    Raises:
        ValueError: ``requested`` names no built library, or one this CPU cannot run.
    """
    runnable = [label for label, level in libraries if level <= cpu_level]
    if requested:
        wanted = requested.strip().replace("-", "_")
        built = [label for label, _ in libraries]
        if wanted not in built:
            raise ValueError(
                f"{ISA_ENV}={requested!r} names no CPU kernel library of this build; built: {built}"
            )
        if wanted not in runnable:
            raise ValueError(f"{ISA_ENV}={requested!r}: this CPU lacks that ISA; it runs: {runnable}")
        return wanted
    if not runnable:
        built = [label for label, _ in libraries]
        raise ValueError(f"this CPU runs none of the CPU kernel libraries built: {built}")
    return runnable[0]


def _load_cpu_library(module: Any, state: dict[str, Any]) -> str:
    """Load the CPU kernel library for this CPU into torch (its ops register); the reason if not, else ''."""
    libraries = cpu_libraries(module)
    state["cpu_isas"] = [label for label, _ in libraries]
    state["cpu_level"] = int(getattr(module, "CPU_LEVEL", 0))
    if not libraries:
        return f"bert_cluster._C lists no CPU kernel library (an older build?); rebuild: {BUILD_HINT}"
    try:
        label = choose_cpu_library(libraries, state["cpu_level"], environment.cpu_isa_override())
    except ValueError as error:
        return str(error)
    folder = Path(getattr(module, "__file__", "") or ".").parent
    found = sorted(p for p in folder.glob(f"_C_cpu_{label}.*") if p.suffix in (".so", ".pyd", ".dylib"))
    if not found:
        return f"the CPU kernel library {label} is missing next to {folder / '_C'}; rebuild: {BUILD_HINT}"
    path = str(found[0])
    if _cpu_library and _cpu_library[0] != path:
        return f"this process already loaded {_cpu_library[0]} (a process loads one CPU kernel library)"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as error:  # undefined symbol (another libtorch), a duplicate registration
        return f"the CPU kernel library {found[0].name} did not load: {error}; rebuild: {BUILD_HINT}"
    _cpu_library[:] = [path]
    state.update(cpu_isa=label, cpu_library=path)
    return ""


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether ``bert_cluster::<op>`` has an implementation registered for ``dispatch_key`` (CPU, CUDA)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"bert_cluster::{op}", dispatch_key))


def _warn_once(reason: str) -> None:
    global _warned
    if _warned or environment.kernels_disabled():
        return
    _warned = True
    warnings.warn(
        f"bert_cluster: compiled kernels unavailable, running the PyTorch reference instead: {reason}",
        RuntimeWarning,
        stacklevel=4,
    )
