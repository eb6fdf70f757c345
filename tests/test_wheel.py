"""The package as a user gets it: ``python -m build`` on a clean copy of the checkout (an sdist, then a
wheel built from it in an isolated environment), ``pip install`` of that wheel into a fresh venv outside
the checkout, then ``bert-cluster env`` and a tiny evaluation run from there with the wheel's own compiled
kernels. Nothing of the checkout is importable in the venv (the run's folder and PYTHONPATH lie outside
it), so a wheel without its kernels, or without configs/ and data/, fails here.

Slow, so marked slow; it runs in CI. Measured on an idle 2-core machine: build 3 min 20 s (most of it
compiling the three CPU libraries), install 1 min 40 s from the local package index, env + evaluation
25 s; 19 min when six other jobs shared the cores.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow(
        reason="builds the sdist and wheel (three CPU kernel libraries), installs it into two venvs"
    ),
    # The build's own limit is 2400 s (the 600 s default would stop it on a loaded machine).
    pytest.mark.timeout(2400),
]

REPO = Path(__file__).resolve().parents[1]
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# The CPU kernel libraries of a portable x86-64 build (setup.py's _cpu_libraries), best first.
CPU_LIBRARIES = ["x86_64_v4", "x86_64_v3", "x86_64"] if X86_64 else ["generic"]


def _checkout_files() -> list[str]:
    """The checkout's files as a clone would have them: tracked and untracked-but-not-ignored, no builds."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the wheel test copies the checkout's files")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listing.split("\0") if name and (REPO / name).is_file()]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment less what would point a subprocess at the checkout or change the build/run."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("BERT_CLUSTER_") and key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env["BERT_CLUSTER_CACHE_DIR"] = os.environ.get("BERT_CLUSTER_CACHE_DIR", "")  # the tests' temp cache
    env["HF_HUB_OFFLINE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(command)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def _version() -> str:
    text = (REPO / "bert_cluster" / "_version.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', text, re.M).group(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """``python -m build`` (sdist, then the wheel from it) on a copy of the checkout; the two files."""
    work = tmp_path_factory.mktemp("wheel-build")
    source = work / "src"
    for name in _checkout_files():
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    dist = work / "dist"
    # scripts/test.sh's kernel cache (setup.py, BERT_CLUSTER_KERNEL_CACHE): the libraries its editable
    # install built from the same inputs, not compiled a second time. The sdist must still carry every file
    # under kernels/, else the inputs differ and the wheel compiles from what it carries.
    cache = {"BERT_CLUSTER_KERNEL_CACHE": os.environ.get("BERT_CLUSTER_KERNEL_CACHE", "")}
    command = [sys.executable, "-m", "build", "--outdir", str(dist), str(source)]
    _run(command, work, _clean_env(**cache), 2400)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "work": work}


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel (and its demo extra) installed by pip."""
    root = tmp_path_factory.mktemp("wheel-venv") / "venv"
    _run([sys.executable, "-m", "venv", str(root)], root.parent, _clean_env(), 300)
    import torch

    # The wheel requires a torch range: this torch (the build's) pinned in the same command, so that
    # nothing pulls another (multi-GB CUDA) torch and the wheel's prebuilt kernels are the ones that load.
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    # --no-compile: pip compiles every installed module to bytecode on one core, two thirds of the install's
    # CPU time (torch 2.13.0 and the dependencies into a new venv: 64 + 6 s with it, 21 + 3 s without); an
    # error there is only a warning, so the install checks the same without it.
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, torch_pin, f"{built['wheel']}[demo]"], root.parent, _clean_env(), 1800)
    return root


def _torch_requirement(wheel: Path) -> str:
    """The wheel's torch requirement, e.g. ``torch<2.15,>=2.11``."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"bert_cluster-{_version()}.dist-info/METADATA").decode()
    found = re.findall(r"^Requires-Dist: (torch[<>=!~,.\d]+)$", metadata, re.M)
    assert len(found) == 1, "the wheel must require one torch range"
    return found[0]


def _torch_range() -> str:
    """pyproject.toml's torch range (``>=2.11,<2.15``)."""
    return re.search(r'^\s*"torch(>=[\d.]+,<[\d.]+)",', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def test_wheel_is_abi3_and_carries_kernels_configs_and_data(built):
    import torch

    wheel = built["wheel"]
    tag = rf"bert_cluster-{re.escape(_version())}-cp310-abi3-[\w.]+\.whl"  # limited API: any CPython >= 3.10
    assert re.fullmatch(tag, wheel.name), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for library in ["_C", *(f"_C_cpu_{label}" for label in CPU_LIBRARIES)]:
        assert f"bert_cluster/{library}.abi3.so" in names, f"{library} missing from {wheel.name}"
    assert "bert_cluster/configs/eval/default.yaml" in names
    assert len([n for n in names if n.startswith("bert_cluster/configs/tasks/")]) >= 10
    assert "bert_cluster/data/stsb_dev.tsv.gz" in names
    # The CUDA sources, for the first-use build on a GPU machine (bert_cluster._cuda_jit).
    cuda = {f"bert_cluster/kernels/cuda/{p.name}" for p in (REPO / "kernels" / "cuda").iterdir()}
    assert cuda | {"bert_cluster/kernels/checks.h"} <= names, sorted(cuda - names)
    # A range that holds the torch the kernels link against (other releases build them on first use).
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    required = Requirement(_torch_requirement(wheel)).specifier
    assert required == SpecifierSet(_torch_range())
    assert torch.__version__.split("+")[0] in required
    cpu = {f"bert_cluster/kernels/cpu/{p.name}" for p in (REPO / "kernels" / "cpu").iterdir()}
    assert cpu <= names, sorted(cpu - names)  # the CPU sources, for the first-use CPU build
    # The sdist carries the kernel headers setuptools would leave out (the wheel above was built from it).
    with tarfile.open(built["sdist"]) as archive:
        inside = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    headers = {"kernels/checks.h", "kernels/cpu/simd.h", "kernels/cuda/common.cuh"}
    assert headers | {"configs/eval/default.yaml"} <= inside


def test_installed_wheel_loads_its_own_kernels(venv, tmp_path):
    env = _clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    facts = json.loads(_run([str(venv / "bin" / "bert-cluster"), "env", "--json"], tmp_path, env, 300).stdout)
    site = (venv / "lib").resolve()
    assert facts["kernels_loaded"], facts["kernels_reason"]
    assert Path(facts["kernels_path"]).resolve().is_relative_to(site), facts["kernels_path"]
    assert facts["kernels_cpu_isas_built"] == CPU_LIBRARIES
    assert facts["auto_backend_cpu"] == "cpu"
    # The first-use CUDA build finds the wheel's own copy of the sources (no checkout beside it).
    probe = "from bert_cluster import _cuda_sources as s; print(s.kernels_dir())"
    found = _run([str(venv / "bin" / "python"), "-c", probe], tmp_path, env, 120).stdout.strip()
    assert Path(found).resolve().is_relative_to(site) and Path(found).name == "kernels", found
    version = _run([str(venv / "bin" / "bert-cluster"), "--version"], tmp_path, env, 120).stdout
    assert version.strip() == f"bert-cluster {_version()}"


def test_installed_wheel_runs_a_tiny_evaluation_on_the_compiled_kernels(venv, tmp_path):
    env = _clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    tasks = json.loads(_run([str(venv / "bin" / "bert-cluster"), "ls", "--json"], tmp_path, env, 300).stdout)
    assert "stsb-embedding" in {task["name"] for task in tasks}  # the packaged configs
    command = [str(venv / "bin" / "bert-cluster"), "evaluate", "--task", "stsb-embedding", "--limit", "32"]
    command += ["--clusters", "10", "--backend", "cpu", "--quiet", "--output", str(tmp_path / "out")]
    _run(command, tmp_path, env, 900)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    site = (venv / "lib").resolve()
    assert results["complete"]
    assert Path(results["settings"]["model"]).resolve().is_relative_to(site)  # the demo model's package
    kernels = results["environment"]["kernels"]
    assert kernels["kernels_loaded"] and Path(kernels["kernels_path"]).resolve().is_relative_to(site)
    (task,) = results["tasks"]
    assert task["status"] == "ok" and task["examples"] == 32
    assert Path(task["source"]).resolve().is_relative_to(site)  # the packaged data
    clustered = [run for run in task["runs"] if run["clusters"] == 10]
    # The backend each run actually used: the compiled CPU kernels, not the reference.
    assert clustered and all(run["backend"] == "cpu" for run in clustered), [r["backend"] for r in clustered]
    assert all(-100 <= score <= 100 for run in task["runs"] for score in run["scores"].values())


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def test_wheel_beside_torch_2_14_keeps_it_and_builds_its_cpu_kernels_on_first_use(built, tmp_path):
    """A user's venv that already has torch 2.14.1 (here .venv-cuda's, made by scripts/check_cuda_build.sh,
    through a .pth file): installing the wheel keeps that torch (its range admits it), and the CPU kernels,
    prebuilt for 2.13, build on first use into the cache, once, for two processes started together."""
    cuda_venv = REPO / ".venv-cuda"
    probe = [str(cuda_venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"]
    try:
        version = subprocess.run(probe, capture_output=True, text=True, timeout=120).stdout.strip()
    except OSError:
        version = ""
    if not version.startswith("2.14."):
        pytest.skip("needs .venv-cuda with torch 2.14 (bash scripts/check_cuda_build.sh makes it)")
    root = tmp_path / "venv"
    _run([str(cuda_venv / "bin" / "python"), "-m", "venv", str(root)], tmp_path, _clean_env(), 300)
    (_site_packages(root) / "user_torch.pth").write_text(str(_site_packages(cuda_venv)) + "\n")
    python = str(root / "bin" / "python")
    # Its dependencies are the user's (not fetched here): torch must satisfy the wheel's own range.
    _run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", str(built["wheel"])],
        tmp_path,
        _clean_env(),
        600,
    )
    check = (
        "import importlib.metadata as m, torch; from packaging.requirements import Requirement\n"
        "req = next(Requirement(r) for r in m.requires('bert-cluster') if r.startswith('torch'))\n"
        "print(torch.__version__, torch.__version__.split('+')[0] in req.specifier)"
    )
    assert _run([python, "-c", check], tmp_path, _clean_env(), 120).stdout.split() == [version, "True"]
    cache = tmp_path / "cache"
    run = (
        "import json, torch; from bert_cluster import dispatch, ops, reference as ref\n"
        "s = ops.load_kernels()\n"
        "q = torch.randn(1, 2, 50, 16); planes = torch.randn(20, 16); offsets = torch.randn(20)\n"
        "same = torch.equal(dispatch.BACKENDS['cpu'].hash_queries(q, planes, offsets), "
        "ref.hash_queries(q, planes, offsets))\n"
        "print(json.dumps({'loaded': s['loaded'], 'reason': s['reason'], "
        "'first_use': s.get('built_on_first_use'), 'library': s.get('cpu_library'), "
        "'torch': torch.__version__, 'same': same}))"
    )
    env = _clean_env(BERT_CLUSTER_CACHE_DIR=str(cache))
    procs = [
        subprocess.Popen(
            [python, "-c", run], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=2400)
        assert proc.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    for facts in results:
        assert facts["loaded"] and facts["first_use"], facts["reason"]
        assert facts["torch"] == version and facts["same"]
        assert Path(facts["library"]).resolve().is_relative_to(cache.resolve()), facts["library"]
    assert results[0]["library"] == results[1]["library"]
    assert len(list((cache / "cpu-kernels").glob("*/*.so"))) == 1  # built once
