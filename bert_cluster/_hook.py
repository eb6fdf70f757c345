"""Deferred registration, so that a converted checkpoint reloads after ``import bert_cluster``.

A checkpoint saved after ``convert`` has ``attn_implementation: bert_cluster (import bert_cluster before
from_pretrained)`` in its config.json (``hf.ATTENTION_NAME``), and transformers rejects an implementation
name nobody registered, quoting it. Registering at import would mean importing transformers (seconds)
for every ``import bert_cluster``; instead this hook waits until ``transformers.modeling_utils`` is
loaded by whoever needs it, then registers (a few dict insertions).
"""

from __future__ import annotations

import importlib.abc
import sys

_TARGET = "transformers.modeling_utils"


def _register() -> None:
    from bert_cluster.hf import register

    register()


class _RegisterAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``transformers.modeling_utils`` to register after it runs."""

    def find_spec(self, fullname, path, target=None):  # noqa: D102 - the finder protocol
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)
            uninstall()
            _register()

        loader.exec_module = exec_module
        return spec


_finder = _RegisterAfterLoad()


def install() -> None:
    """Register now if transformers is already loaded, else once it loads."""
    if _TARGET in sys.modules:
        _register()
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Remove the finder (after it fired, or in tests)."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
