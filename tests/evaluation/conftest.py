"""Fixtures of the evaluation tests: tiny random checkpoints and the real fine-tuned ones (built once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import helpers
import pytest

#: The checkpoints the tests score (build.py writes each in a few seconds).
CHECKPOINTS = ("minilm-l6-rte", "minilm-l6-mrpc", "minilm-l6-stsb", "minilm-l6-squad")


@pytest.fixture(scope="session")
def tiny_cls(tmp_path_factory) -> Path:
    """A random 2-layer BERT classifier with labels (entailment, not_entailment)."""
    return helpers.save_model(tmp_path_factory.mktemp("tiny") / "cls")


@pytest.fixture(scope="session")
def tiny_qa(tmp_path_factory) -> Path:
    """A random 2-layer BERT with a question-answering head."""
    return helpers.save_model(tmp_path_factory.mktemp("tiny") / "qa", head="qa", labels=None)


@pytest.fixture(scope="session")
def tiny_rte(tmp_path_factory) -> Path:
    """A data folder with RTE/dev.tsv (8 rows) in the GLUE layout."""
    folder = tmp_path_factory.mktemp("data")
    helpers.write_rte(folder, helpers.RTE_ROWS)
    return folder


@pytest.fixture(scope="session")
def built_models(shared_dir, minilm_dir, tmp_path_factory) -> Path:
    """The fine-tuned checkpoints of ../shared/models, built once per session into a temporary folder."""
    build = shared_dir / "models" / "build.py"
    if not build.is_file():
        pytest.skip(f"{build} is absent")
    out = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, str(build), str(out), *CHECKPOINTS], check=True, capture_output=True)
    return out
