"""setup.py's kernel cache (``BERT_CLUSTER_KERNEL_CACHE``): a library is reused only when every input of
its build is the same, so a file missing from an sdist, or changed, compiles as it would without the cache.

The key and the pruning are read out of setup.py (running it would build): the functions themselves, in
a namespace whose ``ROOT`` is a folder of the test's.
"""

from __future__ import annotations

import ast
import os
import platform
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def _setup_functions(root: Path) -> dict:
    """``_cache_key`` and ``_prune`` from setup.py, with ``ROOT`` = ``root``."""
    tree = ast.parse(SETUP.read_text())
    wanted = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in ("_cache_key", "_prune")
    ]
    assert len(wanted) == 2, "setup.py must define _cache_key and _prune"
    namespace = {"ROOT": root, "Path": Path, "os": os, "platform": platform}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(SETUP), "exec"), namespace)
    return namespace


def _tree(root: Path) -> Path:
    (root / "kernels" / "cpu").mkdir(parents=True)
    (root / "kernels" / "cpu" / "hash.cpp").write_text('#include "simd.h"\nint hash() { return 1; }\n')
    (root / "kernels" / "cpu" / "simd.h").write_text("// vectors\n")
    (root / "kernels" / "checks.h").write_text("// checks\n")
    return root


def _extension(**changes) -> SimpleNamespace:
    facts = dict(
        name="bert_cluster._C_cpu_x86_64_v4",
        sources=["kernels/cpu/hash.cpp"],
        extra_compile_args={"cxx": ["-O3", "-march=x86-64-v4"]},
        define_macros=[("BERT_CLUSTER_WITH_CUDA", "0")],
        undef_macros=[],
        libraries=[],
        extra_link_args=[],
        py_limited_api=True,
        include_dirs=["/some/venv/torch/include"],
    )
    facts.update(changes)
    return SimpleNamespace(**facts)


COMPILER = SimpleNamespace(compiler_so=[shutil.which("c++") or "c++", "-fPIC"])


def test_the_same_inputs_in_another_folder_share_a_key_and_any_change_makes_another(tmp_path):
    pytest.importorskip("torch")
    checkout = _setup_functions(_tree(tmp_path / "checkout"))
    sdist = _setup_functions(_tree(tmp_path / "sdist"))
    key = checkout["_cache_key"](_extension(), COMPILER)
    # An sdist of the same files, its torch headers elsewhere: the editable install's library serves it.
    assert sdist["_cache_key"](_extension(include_dirs=["/tmp/build-env/torch/include"]), COMPILER) == key
    # A header the sdist lacks, or one changed: another key, so that build compiles.
    (tmp_path / "sdist" / "kernels" / "cpu" / "simd.h").unlink()
    assert sdist["_cache_key"](_extension(), COMPILER) != key
    (tmp_path / "sdist" / "kernels" / "cpu" / "simd.h").write_text("// vectors, changed\n")
    assert sdist["_cache_key"](_extension(), COMPILER) != key
    # Another library, flag or macro: another key.
    for change in (
        {"name": "bert_cluster._C_cpu_x86_64_v3"},
        {"extra_compile_args": {"cxx": ["-O2", "-march=x86-64-v4"]}},
        {"define_macros": [("BERT_CLUSTER_WITH_CUDA", "1")]},
    ):
        assert checkout["_cache_key"](_extension(**change), COMPILER) != key, change


def test_pruning_keeps_the_most_recently_used_libraries_of_that_extension_only(tmp_path):
    functions = _setup_functions(tmp_path)
    now = time.time()
    names = [f"bert_cluster._C_cpu_x86_64-{n}.so" for n in "abc"] + ["bert_cluster._C_cpu_x86_64_v4-a.so"]
    for age, name in enumerate(names):
        (tmp_path / name).write_bytes(b"library")
        os.utime(tmp_path / name, (now - 100 * age, now - 100 * age))
    functions["_prune"](tmp_path, "bert_cluster._C_cpu_x86_64")
    kept = sorted(path.name for path in tmp_path.iterdir())
    assert kept == [names[0], names[1], names[3]]  # the oldest x86_64 one went; v4's is another extension's
