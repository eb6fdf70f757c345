"""First use from many processes: the crossover cache and the kernel build under concurrency.

Several processes start at once (data-parallel workers, two test runs): one measures the crossover and
the others use its figure; one builds the kernels and the others wait for that build; nobody reads a
half-written cache file or library, and nobody waits forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bert_cluster import ClusteredAttentionConfig, _build, crossover, dispatch
from bert_cluster.attention import _clustered

PROCESSES = 4


def start_together(script: str, folder: Path, count: int = PROCESSES) -> list[dict]:
    """Run ``count`` copies of ``script`` released at once (after their imports); each one's JSON line.

    Each copy writes ``ready-<i>`` when its imports are done and then waits for ``go``, so that the part
    after the barrier starts in all of them within a few milliseconds.
    """
    barrier = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        folder = Path({str(folder)!r})
        (folder / f"ready-{{sys.argv[1]}}").touch()
        while not (folder / "go").exists():
            time.sleep(0.002)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script).replace("# BARRIER", barrier), str(index)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for index in range(count)
    ]
    deadline = time.monotonic() + 240
    while len(list(folder.glob("ready-*"))) < count:
        if time.monotonic() > deadline or any(child.poll() not in (None, 0) for child in children):
            for child in children:
                child.kill()
            pytest.fail("a child did not reach the barrier: " + children[0].communicate()[1][-2000:])
        time.sleep(0.01)
    (folder / "go").touch()
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


# --- the crossover cache -------------------------------------------------------------------------------

CROSSOVER_CHILD = """
    import json
    import torch
    from bert_cluster import ClusteredAttentionConfig, crossover, dispatch
    from bert_cluster.attention import _clustered

    # A tiny measurement (a few tenths of a second), cached whatever the machine's load.
    crossover.LENGTHS = (32, 48, 64, 96)
    crossover.REPEATS = 3
    crossover.BUDGET_S = 0.5
    crossover.STABLE_SPREAD = float("inf")
    real_measure, measured = crossover.measure, []
    crossover.measure = lambda *args: measured.append(1) or real_measure(*args)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 4, generator=generator) for _ in range(3))
    config = ClusteredAttentionConfig(clusters=4, topk=3, min_length="auto")
    # BARRIER
    found = crossover.min_length(dispatch.ReferenceBackend(), q, k, v, config, 0.5, _clustered)
    print(json.dumps({"min_length": found, "measured": len(measured)}))
"""


def test_four_processes_on_a_cold_cache_measure_once_and_agree(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(crossover.CACHE_ENV, str(cache))
    results = start_together(CROSSOVER_CHILD, tmp_path)
    assert sum(result["measured"] for result in results) == 1, results  # one measured, three waited
    figures = {result["min_length"] for result in results}
    assert len(figures) == 1, results  # all four use the one figure
    stored = json.loads((cache / crossover.CACHE_FILE).read_text())
    (entry,) = stored.values()
    assert entry["min_length"] == figures.pop() and entry["facts"]["heads"] == 1
    # nothing half-written is left beside it: the cache file and its lock only
    assert sorted(path.name for path in cache.iterdir()) == [
        crossover.CACHE_FILE,
        crossover.CACHE_FILE + ".lock",
    ]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(crossover.CACHE_ENV, str(tmp_path))
    crossover.clear_memory()
    yield tmp_path / crossover.CACHE_FILE
    crossover.clear_memory()


def small_call() -> tuple:
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    return dispatch.ReferenceBackend(), q, k, v, ClusteredAttentionConfig(min_length="auto"), 0.5, _clustered


def test_a_corrupt_cache_file_is_ignored_and_rewritten(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(
        crossover, "measure", lambda *a: calls.append(1) or {"min_length": 321, "timings": []}
    )
    cache.write_text('{"truncated": {"min_len')  # a file cut short
    assert crossover.min_length(*small_call()) == 321
    (name,) = json.loads(cache.read_text())  # valid JSON again, with the one entry
    # an entry of the wrong shape (written by hand, or by another version) is measured again, not trusted
    for broken in (5, {"min_length": "300"}, {"min_length": -1}, None):
        cache.write_text(json.dumps({name: broken, "other": {"min_length": 7}}))
        crossover.clear_memory()
        assert crossover.min_length(*small_call()) == 321
        stored = json.loads(cache.read_text())
        assert stored[name]["min_length"] == 321 and stored["other"] == {"min_length": 7}
    assert len(calls) == 5


@contextlib.contextmanager
def lock_held_by_another_process(path: Path) -> Iterator[None]:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import filelock, sys, time; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); "
            "print('held', flush=True); time.sleep(120)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_held_too_long_does_not_block_the_measurement(cache, monkeypatch):
    monkeypatch.setattr(crossover, "LOCK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(crossover, "measure", lambda *a: {"min_length": 55, "timings": []})
    cache.parent.mkdir(parents=True, exist_ok=True)
    with lock_held_by_another_process(Path(str(cache) + ".lock")):
        start = time.monotonic()
        assert crossover.min_length(*small_call()) == 55
        assert time.monotonic() - start < 5  # waited LOCK_TIMEOUT_S, then measured for itself
    assert json.loads(cache.read_text())  # and still wrote its figure, atomically


# --- the kernel build ----------------------------------------------------------------------------------

#: A stand-in for ``setup.py build_ext``: writes a 1 MB "library" slowly (ten chunks 50 ms apart), as the
#: real build's copy does, into --build-lib or, with --inplace, straight into the package folder.
FAKE_SETUP = """
import os, sys, time
args = sys.argv[1:]
with open("runs.log", "a") as log:
    log.write(f"start {os.getpid()} {time.time()}\\n")
lib = "." if "--inplace" in args else args[args.index("--build-lib") + 1]
out = os.path.join(lib, "bert_cluster")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "_C.abi3.so"), "wb") as library:
    for _ in range(10):
        library.write(b"N" * 100_000)
        library.flush()
        time.sleep(0.05)
with open("runs.log", "a") as log:
    log.write(f"end {os.getpid()} {time.time()}\\n")
"""

BUILDER_CHILD = """
    import json
    from pathlib import Path
    from bert_cluster import _build

    _build._ROOT = Path(sys.argv[2])
    # the check that imports the new build in a fresh interpreter needs a real one: not here
    _build._probe = lambda result, env, cuda: {**result, "ok": True}
    # BARRIER
    result = _build.build_kernels()
    print(json.dumps({key: result.get(key) for key in ("ok", "returncode", "built_by", "log")}))
"""


def fake_checkout(root: Path) -> Path:
    (root / "bert_cluster").mkdir(parents=True)
    (root / "setup.py").write_text(FAKE_SETUP)
    library = root / "bert_cluster" / "_C.abi3.so"
    library.write_bytes(b"O" * 1_000_000)  # the previous build
    return library


def test_two_builders_at_once_build_once_and_no_reader_sees_half_a_library(tmp_path):
    checkout = tmp_path / "checkout"
    library = fake_checkout(checkout)
    seen: list[int] = []
    stop = threading.Event()

    def read_like_the_loader() -> None:
        while not stop.is_set():
            try:
                seen.append(len(library.read_bytes()))
            except FileNotFoundError:
                seen.append(-1)
            time.sleep(0.001)

    reader = threading.Thread(target=read_like_the_loader)
    reader.start()
    try:
        barrier_folder = tmp_path / "barrier"
        barrier_folder.mkdir()
        script = BUILDER_CHILD.replace("sys.argv[2]", repr(str(checkout)))
        script = script.replace("import json", "import json, sys", 1)
        results = start_together(script, barrier_folder, count=2)
    finally:
        stop.set()
        reader.join()
    assert seen and set(seen) <= {1_000_000}, sorted(set(seen))  # the old file or the new one, whole
    runs = (checkout / "runs.log").read_text().split()
    assert runs.count("start") == 1, runs  # one built; the other waited and used that build
    assert all(result["ok"] and result["returncode"] == 0 for result in results), results
    assert len({result["built_by"] for result in results}) == 1, results
    assert library.read_bytes() == b"N" * 1_000_000


def test_a_build_lock_held_too_long_gives_up_with_a_reason(tmp_path, monkeypatch):
    fake_checkout(tmp_path)
    monkeypatch.setattr(_build, "_ROOT", tmp_path)
    monkeypatch.setattr(_build, "_build_and_install", lambda *a: pytest.fail("built without the lock"))
    (tmp_path / "build").mkdir()
    with lock_held_by_another_process(tmp_path / "build" / "kernels-build.lock"):
        result = _build.build_kernels(lock_timeout_s=0.2)
    assert result["ok"] is False and "another kernel build has held" in result["log"]
