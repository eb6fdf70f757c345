"""Fixtures of the server tests: a tiny SentenceTransformer (serve_support holds the rest)."""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> Path:
    """A SentenceTransformer around a random 2-layer BERT (512 positions, mean pooling, normalised)."""
    return helpers.save_sentence_transformer(tmp_path_factory.mktemp("serve") / "tiny-st", max_seq_length=512)
