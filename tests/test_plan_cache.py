"""The routing plan is cached by the config's value, and the config hashes its fields once."""

from __future__ import annotations

import pickle

import torch

from bert_cluster import attention
from bert_cluster.config import ClusteredAttentionConfig


def test_an_equal_config_object_reuses_the_plan(monkeypatch):
    """Two config objects with equal settings (a reloaded checkpoint's, say) share one plan."""
    calls = []
    original = attention._make_plan
    monkeypatch.setattr(attention, "_make_plan", lambda *a: calls.append(1) or original(*a))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=generator) for _ in range(3))
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, 30:] = False
    settings = {"clusters": 6, "topk": 4, "backend": "reference"}
    first = attention.clustered_attention(q, k, v, valid, ClusteredAttentionConfig(**settings))
    again = attention.clustered_attention(q, k, v, valid, ClusteredAttentionConfig(**settings))
    assert torch.equal(first, again) and len(calls) == 1
    attention.clustered_attention(q, k, v, valid, ClusteredAttentionConfig(**{**settings, "clusters": 7}))
    assert len(calls) == 2  # other settings: another plan


def test_the_hash_is_the_fields_and_is_not_carried_across_processes():
    config = ClusteredAttentionConfig(clusters=9, layers=[3, 1])
    assert hash(config) == hash(ClusteredAttentionConfig(clusters=9, layers=(1, 3)))
    assert hash(config) != hash(config.replace(clusters=10))
    copied = pickle.loads(pickle.dumps(config))
    assert copied == config and "_hash" not in copied.__dict__ and hash(copied) == hash(config)
    assert "_hash" not in config.to_dict()
