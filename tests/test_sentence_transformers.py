"""convert / revert accept a sentence-transformers model (issue 10 item 2), on the PyPI all-MiniLM-L6-v2."""

from __future__ import annotations

import pytest
import torch

import bert_cluster
from bert_cluster.hf import ATTENTION_NAME

# Lengths from 3 to ~130 tokens: with clusters=4 every row longer than 4 tokens is clustered.
TEXTS = [
    "A man is playing a guitar.",
    "Clustered attention groups the queries and attends once per cluster. " * 8,
    "Short.",
    "The cat sat on the mat while the dog slept by the door, dreaming of long walks in the park. " * 3,
]


@pytest.fixture
def encoder(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def encode(model):
    return model.encode(TEXTS, batch_size=4, convert_to_tensor=True)


def test_a_converted_sentence_transformer_is_exact_when_topk_covers_every_key(encoder):
    plain = encode(encoder)
    assert bert_cluster.convert(encoder, clusters=4, topk=512, min_length=0) is encoder
    inner = encoder[0].model
    assert inner.config._attn_implementation == ATTENTION_NAME
    assert inner.config.clustered_attention["clusters"] == 4
    assert float((encode(encoder) - plain).abs().max()) < 1e-5  # measured 1.5e-7
    bert_cluster.convert(encoder, clusters=4, topk=2, min_length=0)
    approximate = encode(encoder)
    assert float((approximate - plain).abs().max()) > 1e-3  # measured 0.10: the patch is really in use


def test_revert_restores_a_sentence_transformer_bit_for_bit(encoder):
    plain = encode(encoder)
    bert_cluster.convert(encoder, clusters=4, topk=2, min_length=0)
    assert not torch.equal(encode(encoder), plain)
    assert bert_cluster.revert(encoder) is encoder
    assert encoder[0].model.config._attn_implementation == "sdpa"
    assert torch.equal(encode(encoder), plain)


def test_a_saved_sentence_transformer_reloads_with_its_patch(encoder, tmp_path):
    from sentence_transformers import SentenceTransformer

    bert_cluster.convert(encoder, clusters=4, topk=2, seed=3, min_length=0)
    expected = encode(encoder)
    encoder.save(str(tmp_path))
    reloaded = SentenceTransformer(str(tmp_path), device="cpu")
    assert reloaded[0].model.config.clustered_attention["seed"] == 3
    assert torch.equal(encode(reloaded), expected)


def test_a_sentence_transformer_refuses_bad_settings_like_a_model(encoder):
    with pytest.raises(ValueError, match="clusters must be >= 1"):
        bert_cluster.convert(encoder, clusters=0)
    assert not hasattr(encoder[0].model.config, "clustered_attention")
