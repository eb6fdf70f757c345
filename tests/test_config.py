"""ClusteredAttentionConfig: validation messages and the serialised form."""

from __future__ import annotations

import json

import pytest

from bert_cluster import ClusteredAttentionConfig
from bert_cluster.config import CONFIG_VERSION


def test_round_trip_through_json_keeps_every_field():
    config = ClusteredAttentionConfig(
        clusters=7,
        topk=5,
        bits=12,
        iterations=3,
        mode="clustered",
        min_length=40,
        seed=9,
        layers=[3, 1, 1],
        backend="reference",
    )
    data = json.loads(json.dumps(config.to_dict()))
    assert data["version"] == CONFIG_VERSION and data["layers"] == [1, 3]
    assert ClusteredAttentionConfig.from_dict(data) == config


def test_from_dict_refuses_unknown_keys_and_newer_versions():
    with pytest.raises(ValueError, match=r"unknown clustered attention setting\(s\) \['cluster'\]"):
        ClusteredAttentionConfig.from_dict({"cluster": 3})
    with pytest.raises(ValueError, match="newer than this bert-cluster"):
        ClusteredAttentionConfig.from_dict({"version": CONFIG_VERSION + 1})


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("clusters", 0, ValueError, "clusters must be >= 1, got 0"),
        ("clusters", True, TypeError, "clusters must be an int"),
        ("topk", -1, ValueError, "topk must be >= 1"),
        ("bits", 64, ValueError, r"bits must be in 1\.\.63"),
        ("iterations", 0, ValueError, "iterations must be >= 1"),
        ("min_length", -2, ValueError, "min_length must be >= 0"),
        ("mode", "exact", ValueError, "mode must be one of i-clustered, clustered"),
        ("backend", "gpu", ValueError, "backend must be one of auto, cpu, cuda, reference"),
        ("layers", "0,1", TypeError, "layers must be None or a sequence of ints"),
        ("layers", [0, "1"], TypeError, "layers must hold ints"),
    ],
)
def test_each_bad_field_gets_a_message_saying_what_is_allowed(field, value, error, message):
    with pytest.raises(error, match=message):
        ClusteredAttentionConfig(**{field: value})


def test_replace_validates_again():
    with pytest.raises(ValueError, match="clusters must be >= 1"):
        ClusteredAttentionConfig().replace(clusters=0)
    assert ClusteredAttentionConfig().replace(clusters=3).clusters == 3
