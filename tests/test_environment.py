"""bert_cluster.environment: the one reader of the environment variables and of the machine's facts;
and the package's import graph, which has no circle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bert_cluster import _build, environment

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bert_cluster"


def test_flags_and_overrides_are_read_when_asked(monkeypatch):
    for value, disabled in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(environment.DISABLE_KERNELS, value)
        assert environment.kernels_disabled() is disabled
    monkeypatch.delenv(environment.DISABLE_KERNELS)
    assert environment.kernels_disabled() is False
    monkeypatch.setenv(environment.BACKEND, "  reference ")
    assert environment.backend_override() == "reference"
    monkeypatch.setenv(environment.BACKEND, " ")
    assert environment.backend_override() is None
    monkeypatch.setenv(environment.CPU_ISA, "x86-64-v3")
    assert environment.cpu_isa_override() == "x86-64-v3"
    monkeypatch.setenv(environment.BACKEND, "cpu")
    assert environment.backend_key() == ("cpu", None)


def test_folders(monkeypatch, tmp_path):
    monkeypatch.setenv(environment.CACHE_DIR, str(tmp_path / "c"))
    assert environment.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(environment.CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert environment.cache_dir() == tmp_path / "x" / "bert-cluster"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert environment.cache_dir() == Path.home() / ".cache" / "bert-cluster"
    monkeypatch.setenv(environment.DATA_DIR, f"{tmp_path / 'a'}:{tmp_path / 'b'}:")
    assert environment.data_dirs() == [tmp_path / "a", tmp_path / "b"]
    monkeypatch.delenv(environment.CONFIGS, raising=False)
    assert environment.configs_dir() is None
    monkeypatch.delenv(environment.SHARED, raising=False)
    assert environment.shared_dir(tmp_path) == tmp_path
    monkeypatch.setenv(environment.SHARED, str(tmp_path / "s"))
    assert environment.shared_dir(tmp_path) == tmp_path / "s"


def test_facts_describe_this_machine():
    facts = environment.facts()
    import torch

    import bert_cluster

    assert facts["torch"] == str(torch.__version__) and facts["bert_cluster"] == bert_cluster.__version__
    assert facts["threads"] == torch.get_num_threads() and facts["cpu"]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line
        ]
        if names:
            assert facts["cpu"] == names[0]
    assert environment.device_name("cpu") == facts["cpu"]
    assert environment.package_version("no-such-distribution-here") is None


def test_env_reports_the_same_keys():
    """``bert-cluster env`` kept its keys when its readers moved here."""
    assert set(_build.build_info()) == {
        "python", "platform", "torch", "torch_cuda", "cuda_available", "cuda_devices", "compiler", "threads",
        "parallel_backend", "kernels_loaded", "kernels_reason", "kernels_path", "kernels_built_for_torch",
        "kernels_with_cuda", "kernels_cpu_isa", "kernels_cpu_isas_built", "kernels_disabled_by_env",
        "backend_env", "backends", "auto_backend_cpu",
    }  # fmt: skip


def _sources() -> list[Path]:
    return sorted(
        [*PACKAGE.rglob("*.py"), *(REPO / "benchmarks").glob("*.py"), *(REPO / "scripts").glob("*.py")]
    )


def test_environment_variables_and_cpuinfo_have_one_reader():
    """No module but environment reads a BERT_CLUSTER_* variable or /proc/cpuinfo itself."""
    readers = []
    for path in _sources():
        if path == PACKAGE / "environment.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                function = node.func
                called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
                if called in ("get", "getenv", "pop", "setdefault", "open", "read_text", "Path"):
                    name = node.args[0].value
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                name = node.slice.value
            if isinstance(name, str) and (name.startswith("BERT_CLUSTER_") or name == "/proc/cpuinfo"):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert readers == []


# --- the import graph ----------------------------------------------------------------------------------


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at module level or in a function; those under ``if TYPE_CHECKING`` left out."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            else:
                visit(child)

    visit(tree)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at import time or later (in a function).

    Importing ``a.b.c`` imports ``a`` and ``a.b`` first, so those count too, except a module's own
    packages: they are importing already when it runs (a registry package such as
    ``tasks.kinds`` imports its plug-ins at its end, after the names they take from it; every
    module takes ``__version__`` and friends from the top package).
    """
    paths = sorted(package.rglob("*.py"))
    modules = {_module_name(path, package.parent) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = _module_name(path, package.parent)
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(
                        here[: len(here) - node.level + 1] + ([node.module] if node.module else [])
                    )
                wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in wanted:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                while target:
                    own = target == name or name.startswith(target + ".")
                    if not own:
                        targets.add(target)
                    target = target.rpartition(".")[0]
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append([*stack[stack.index(target) :], target])
            elif target not in state:
                walk(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return found


def test_the_import_graph_walk_finds_a_circle(tmp_path):
    """The check below can fail: a deferred import back into a module that imports it is a circle, and so
    is one through the package of a module imported (importing ``pkg.sub.d`` runs ``pkg/sub/__init__``)."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from pkg.a import f\n")
    (package / "c.py").write_text("from pkg.sub.d import g\n")
    (package / "sub" / "__init__.py").write_text("from .. import c\n")
    (package / "sub" / "d.py").write_text("def g():\n    pass\n")
    assert circles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub", "pkg.c"]]
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
    )
    (package / "sub" / "__init__.py").write_text("")
    assert circles(import_graph(package)) == []


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert "bert_cluster.environment" in graph and "bert_cluster.crossover" in graph
    # The bottom, everyone may import it: it reads only the version constant (bert_cluster/_version.py).
    assert graph["bert_cluster.environment"] <= {"bert_cluster._version"}
    assert circles(graph) == []


@pytest.mark.slow(reason="one forked interpreter per module (about 90) importing it alone")
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module imports on its own, first (a circle entered there shows up as an ImportError).

    One interpreter imports torch, then forks a child per module, which imports only that module: a fresh
    ``bert_cluster`` each time, without paying torch's import for every module.
    """
    modules = sorted(name for name in import_graph(PACKAGE) if name != "bert_cluster.__main__")
    code = textwrap.dedent(f"""
        import importlib, json, os, sys, traceback
        import torch
        failed = {{}}
        for name in {modules!r}:
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                os.close(read)
                try:
                    importlib.import_module(name)
                except BaseException:
                    os.write(write, traceback.format_exc()[-800:].encode())
                    os._exit(1)
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as pipe:
                message = pipe.read()
            _, status = os.waitpid(child, 0)
            if status:
                failed[name] = message or f"exit status {{status}}"
        print(json.dumps(failed))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize(
    "name", ["bert_cluster.crossover", "bert_cluster._loader", "bert_cluster.environment"]
)
def test_low_modules_import_nothing_above_them(name):
    graph = import_graph(PACKAGE)
    above = {"bert_cluster.attention", "bert_cluster._build", "bert_cluster.hf"}
    assert not graph[name] & above, graph[name]
