"""Guarded import of the compiled kernels (``bert_cluster._C``) and why it failed: nothing else.

Nothing here runs at ``import bert_cluster``, and this module imports nothing from the package (so it
sits below ``ops``, ``dispatch`` and ``_build`` with no import circle). ``bert_cluster.ops.load_kernels``
calls ``load()`` once the op schemas exist; ``_C``'s ``TORCH_LIBRARY_IMPL`` blocks then register the CPU
and CUDA implementations. A failure (absent, built for another torch, another import error) is stored,
reported once as a ``RuntimeWarning``, and the library runs on the reference.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import torch

BUILD_HINT = "build it with `pip install --no-build-isolation -e .` or `bert-cluster kernels build`"

_state: dict[str, Any] | None = None  # filled by load(); read by everything else
_warned = False


def load() -> dict[str, Any]:
    """Import ``bert_cluster._C`` once and return what happened.

    Returns:
        ``loaded`` (bool), ``reason`` (why not, empty when loaded) and the facts the build carries:
        ``torch_version`` it was built for, ``with_cuda``, ``compiler``, ``path``.
    """
    global _state
    if _state is not None:
        return _state
    state: dict[str, Any] = {"loaded": False, "reason": "", "torch_version": None, "with_cuda": False}
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
                f"built for another torch ({built_for}, running {torch.__version__}); rebuild: {BUILD_HINT}"
            )
        else:
            state["loaded"] = True
    _state = state
    if not state["loaded"]:
        _warn_once(state["reason"])
    return state


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether ``bert_cluster::<op>`` has an implementation registered for ``dispatch_key`` (CPU, CUDA)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"bert_cluster::{op}", dispatch_key))


def _warn_once(reason: str) -> None:
    global _warned
    if _warned or os.environ.get("BERT_CLUSTER_DISABLE_KERNELS", "") not in ("", "0"):
        return
    _warned = True
    warnings.warn(
        f"bert_cluster: compiled kernels unavailable, running the PyTorch reference instead: {reason}",
        RuntimeWarning,
        stacklevel=4,
    )


def __getattr__(name: str) -> Any:
    # Compatibility: build_info and build_kernels moved to bert_cluster._build (import them from there).
    if name in ("build_info", "build_kernels"):
        from bert_cluster import _build

        return getattr(_build, name)
    raise AttributeError(f"module 'bert_cluster._loader' has no attribute {name!r}")
