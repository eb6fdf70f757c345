"""The package's layers, read from its imports (top-level and inside functions) with ``ast``.

docs/development.md draws the same picture. A module may import its own layer and the layers below it;
``tasks`` (the task configs, their data and kinds) is the base both ``evaluation`` and ``finetuning``
drive; a feature (``evaluation``, ``embedding``, ``inspection``, ``finetuning``, ``serve``) imports no
other feature; no module imports a private name (``_x``) of another unit; only the shell imports the
package's facade (``bert_cluster``). Task YAML is read in ``tasks`` alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bert_cluster"

#: Lowest first. A unit is a top-level module or a subpackage of bert_cluster.
LAYERS: dict[str, tuple[str, ...]] = {
    "core": (
        "_version",
        "environment",
        "config",
        "steps",
        "reference",
        "_loader",
        "_cuda_sources",
        "_cuda_jit",
        "_cpu_jit",
        "ops",
        "dispatch",
        "crossover",
        "attention",
        "hf",
        "_hook",
        "_build",
    ),
    "base": ("errors", "checkpoints", "parallel", "reports", "datafiles"),
    "tasks": ("tasks",),
    "features": ("evaluation", "embedding", "inspection", "finetuning", "serve"),
    "shell": ("render", "cli", "__main__"),
}
#: The public API module (``bert_cluster/__init__.py``): it sits on the core and reaches the features
#: lazily; below the shell nothing imports it.
FACADE = "bert_cluster"
RANK = {unit: rank for rank, units in enumerate(LAYERS.values()) for unit in units}
LAYER_OF = {unit: layer for layer, units in LAYERS.items() for unit in units}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """``bert_cluster.tasks.kinds.squad`` -> ``tasks``; the package itself -> the facade."""
    parts = module.split(".")
    return FACADE if len(parts) == 1 else parts[1]


def imports(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str, str]]:
    """``(line, imported module, name)`` for every import of the package, wherever it stands.

    ``from bert_cluster import hf`` names the module ``bert_cluster.hf``; ``from bert_cluster import
    convert`` names the facade and ``convert``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((node.lineno, *((target, "") if target in known else (base, alias.name))))
    return [(line, target, name) for line, target, name in found if target.split(".")[0] == FACADE]


def private(target: str, name: str) -> bool:
    """True for ``_x`` (a dunder such as ``__version__`` is public) in the name or below the unit."""
    return any(part.startswith("_") and not part.startswith("__") for part in [*target.split(".")[2:], name])


def violations(files: dict[str, str], packages: set[str]) -> list[str]:
    """Every import among ``files`` (module name -> source) that breaks the layers."""
    known = set(files)
    problems = []
    for module, source in sorted(files.items()):
        unit = unit_of(module)
        for line, target, name in imports(source, module, module in packages, known):
            where = f"{module}:{line} imports {target}{'.' + name if name else ''}"
            other = unit_of(target)
            if other == unit and unit != FACADE:
                continue
            if other == FACADE:
                if LAYER_OF.get(unit) != "shell":
                    problems.append(f"{where}: only the shell imports the facade (import the module itself)")
                continue
            if unit == FACADE:
                if LAYER_OF.get(other) == "shell":
                    problems.append(f"{where}: the facade imports the shell")
                continue
            if unit not in RANK or other not in RANK:
                problems.append(f"{where}: {unit if unit not in RANK else other} is in no layer (add it)")
                continue
            if RANK[other] > RANK[unit]:
                problems.append(f"{where}: {LAYER_OF[unit]} imports {LAYER_OF[other]} (a layer above)")
            elif LAYER_OF[unit] == LAYER_OF[other] == "features":
                problems.append(f"{where}: a feature imports another feature")
            elif private(target, name) and not LAYER_OF[unit] == LAYER_OF[other] == "core":
                problems.append(f"{where}: a private name of another unit")
    return problems


def package_files() -> tuple[dict[str, str], set[str]]:
    files, packages = {}, set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path, PACKAGE)
        files[name] = path.read_text(encoding="utf-8")
        if path.name == "__init__.py":
            packages.add(name)
    return files, packages


def test_every_unit_of_the_package_is_in_a_layer():
    files, _ = package_files()
    units = {unit_of(module) for module in files} - {FACADE}
    assert units - set(RANK) == set(), "add them to LAYERS (and to docs/development.md)"
    assert set(RANK) - units == set(), "gone from the package: remove them from LAYERS"


def test_the_package_keeps_its_layers():
    files, packages = package_files()
    assert violations(files, packages) == []


#: The unit that reads task YAML (configs/tasks/**, and the run files beside them): the one YAML reader.
YAML_READER = "tasks"


def yaml_readers(files: dict[str, str], packages: set[str]) -> list[str]:
    """Every module outside ``YAML_READER`` that imports a YAML parser (``yaml``, ``ruamel.yaml``)."""
    found = []
    for module, source in sorted(files.items()):
        if unit_of(module) == YAML_READER:
            continue
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(name.split(".")[0] == "yaml" or name.startswith("ruamel.yaml") for name in names):
                found.append(f"{module}:{node.lineno}")
    return found


def test_no_module_outside_tasks_parses_task_yaml():
    """Issue 70: the task config is read in one place; evaluate and finetune drive ``bert_cluster.tasks``."""
    files, packages = package_files()
    assert yaml_readers(files, packages) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("bert_cluster.evaluation", "def f():\n    import yaml\n"),
        ("bert_cluster.finetuning", "from yaml import safe_load\n"),
        ("bert_cluster.cli", "from ruamel.yaml import YAML\n"),
    ],
)
def test_the_yaml_check_finds_a_parser_outside_tasks(module, source):
    files, packages = package_files()
    files[module] = source
    assert [entry.split(":")[0] for entry in yaml_readers(files, packages)] == [module]


@pytest.mark.parametrize(
    ("module", "source", "message"),
    [
        ("bert_cluster.attention", "def f():\n    from bert_cluster import checkpoints\n", "imports base"),
        ("bert_cluster.errors", "from bert_cluster.evaluation.report import Results\n", "imports features"),
        ("bert_cluster.embedding.run", "from bert_cluster.evaluation import data\n", "another feature"),
        ("bert_cluster.inspection", "def f():\n    from bert_cluster.evaluation import tuner\n", "another"),
        ("bert_cluster.embedding.run", "from ..evaluation.data import load_rows\n", "another feature"),
        ("bert_cluster.finetuning", "from bert_cluster.evaluation import runner\n", "another feature"),
        ("bert_cluster.finetuning", "from bert_cluster.tasks.data import _squad_rows\n", "private name"),
        ("bert_cluster.reports", "import bert_cluster\n", "only the shell imports the facade"),
        ("bert_cluster.checkpoints", "from bert_cluster import convert\n", "only the shell imports"),
        ("bert_cluster.inspection", "from bert_cluster.hf import _layer_indices\n", "a private name"),
        ("bert_cluster.embedding", "from bert_cluster.checkpoints import _package_model_dir\n", "private"),
        ("bert_cluster.parallel", "from bert_cluster.render import table\n", "base imports shell"),
        ("bert_cluster.newthing", "from bert_cluster import config\n", "in no layer"),
    ],
)
def test_the_check_finds_each_kind_of_break(module, source, message):
    files, packages = package_files()
    files[module] = source
    found = violations(files, packages)
    assert any(message in problem and problem.startswith(module) for problem in found), found


# --- benchmarks/ and the rest of the checkout ------------------------------------------------------------

REPO = PACKAGE.parent
BENCHMARKS = REPO / "benchmarks"
#: Edits of the import path: what a package layout (``python -m``, pytest's ``pythonpath``) makes unneeded.
PATH_EDIT = re.compile(
    r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop)\s*\(|\[[^\]]*\]\s*=|\+?=)|addsitedir\("
)


def hidden(*parts: str) -> bool:
    """A ``_x`` among the parts (a dunder such as ``__version__`` is public)."""
    return any(part.startswith("_") and not part.startswith("__") for part in parts)


def private_reaches(source: str) -> list[str]:
    """Each private name of bert_cluster that ``source`` imports or reaches through an imported module
    (``from bert_cluster._build import ...``, ``from bert_cluster.crossover import _read``,
    ``attention._clustered = ...``)."""
    found, bound = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == FACADE:
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if hidden(*alias.name.split(".")[1:]):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == FACADE
            and not node.level
        ):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if hidden(*node.module.split(".")[1:], alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and hidden(node.attr)
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def python_files() -> list[Path]:
    """Every Python file of the checkout: the package, benchmarks, scripts, tests, setup.py (not a virtual
    environment's: ``.venv``, ``.venv-peers``, ``.venv-infinity``, ...)."""

    def ours(path: Path) -> bool:
        top = path.relative_to(REPO).parts[0]
        return not top.startswith(".venv") and top not in ("build", ".git")

    return sorted(path for path in REPO.rglob("*.py") if ours(path))


def test_benchmarks_use_only_the_packages_public_names():
    """Issue 70: a benchmark that needs an internal gets a public hook (``attention.replaced_steps``,
    ``crossover.stored``), never a private import or a monkeypatch."""
    found = {
        str(path.relative_to(REPO)): reaches
        for path in sorted(BENCHMARKS.glob("*.py"))
        if (reaches := private_reaches(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_no_file_edits_the_import_path():
    """Issue 70: scripts, benchmarks and tests import each other as packages, not through ``sys.path``."""
    edits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in python_files()
        if path != Path(__file__).resolve()  # this file's examples of edits, below
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if PATH_EDIT.search(line)
    ]
    assert edits == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        (
            "from bert_cluster._build import build_info\n",
            ["line 1: from bert_cluster._build import build_info"],
        ),
        ("from bert_cluster.crossover import _read\n", ["line 1: from bert_cluster.crossover import _read"]),
        ("from bert_cluster import _hook\n", ["line 1: from bert_cluster import _hook"]),
        ("import bert_cluster._loader\n", ["line 1: import bert_cluster._loader"]),
        (
            "from bert_cluster import attention\nattention._clustered = None\n",
            ["line 2: attention._clustered"],
        ),
        ("import bert_cluster\nbert_cluster._hook.install()\n", ["line 2: bert_cluster._hook"]),
        ("from bert_cluster import crossover\ncrossover.stored()\n", []),
        ("from bert_cluster import __version__\nimport os\nos._exit(0)\n", []),
    ],
)
def test_the_public_name_check_finds_each_private_reach(source, found):
    assert private_reaches(source) == found


@pytest.mark.parametrize(
    ("line", "edit"),
    [
        ("sys.path.insert(0, str(ROOT))", True),
        ('"import sys; sys.path.insert(0, sys.argv[1]); import bench_attention"', True),
        ("sys.path.append(folder)", True),
        ("sys.path[:0] = [folder]", True),
        ("sys.path += [folder]", True),
        ("site.addsitedir(folder)", True),
        ("print(sys.path)", False),
        ("# a script run from the package (its folder first on sys.path) gets the stdlib inspect", False),
    ],
)
def test_the_path_edit_check_finds_each_kind_of_edit(line, edit):
    assert bool(PATH_EDIT.search(line)) is edit
