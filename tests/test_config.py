"""ClusteredAttentionConfig: validation messages and the serialised form."""

from __future__ import annotations

import json

import pytest

from bert_cluster import ClusteredAttentionConfig
from bert_cluster.config import CONFIG_VERSION, MAX_COUNT, MAX_ITERATIONS


def test_round_trip_through_json_keeps_every_field():
    config = ClusteredAttentionConfig(
        clusters=7,
        topk=5,
        bits=12,
        iterations=3,
        mode="clustered",
        min_length=40,
        cluster_growth=0,
        topk_growth=0.25,
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
        ("min_length", -2, ValueError, "min_length must be >= 0 or 'auto', got -2"),
        ("min_length", "fast", ValueError, "min_length must be an int or 'auto', got 'fast'"),
        ("min_length", 2.5, TypeError, "min_length must be an int or 'auto'"),
        (
            "cluster_growth",
            1.5,
            ValueError,
            r"cluster_growth must be a number in 0\.\.1 \(0: fixed, 1: linear",
        ),
        ("topk_growth", -0.1, ValueError, r"topk_growth must be a number in 0\.\.1"),
        ("topk_growth", "sqrt", ValueError, r"topk_growth must be a number in 0\.\.1"),
        # Counts that would overflow int64 arithmetic in the ops (measured before the bound: 2**63 passed
        # convert and failed in the forward pass).
        ("clusters", 2**63, ValueError, f"clusters must be <= {MAX_COUNT}, got {2**63}"),
        ("topk", 2**63, ValueError, f"topk must be <= {MAX_COUNT}"),
        ("iterations", 2**63, ValueError, f"iterations must be <= {MAX_ITERATIONS}"),
        ("min_length", 2**63, ValueError, f"min_length must be <= {MAX_COUNT} or 'auto'"),
        ("seed", 2**63, ValueError, "seed must be <= 9223372036854775807"),
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


def test_the_largest_allowed_counts_run():
    """The bounds are not just words: a config at every upper bound runs (short rows: exact attention)."""
    import torch

    from bert_cluster import clustered_attention

    config = ClusteredAttentionConfig(
        clusters=MAX_COUNT,
        topk=MAX_COUNT,
        iterations=MAX_ITERATIONS,
        min_length=MAX_COUNT,
        backend="reference",
    )
    q = torch.randn(1, 2, 40, 8)
    out = clustered_attention(q, q, q, None, config)
    assert torch.isfinite(out).all()
    # Long rows with the largest topk and iterations: k is capped at the row's keys, K-means stops early.
    config = ClusteredAttentionConfig(
        clusters=3, topk=MAX_COUNT, iterations=MAX_ITERATIONS, backend="reference"
    )
    out = clustered_attention(q, q, q, None, config)
    assert torch.isfinite(out).all()


def test_min_length_auto_and_growth_round_trip():
    config = ClusteredAttentionConfig(min_length="auto", cluster_growth=1, topk_growth=0.25)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["min_length"] == "auto" and data["cluster_growth"] == 1.0 and data["topk_growth"] == 0.25
    assert ClusteredAttentionConfig.from_dict(data) == config


def test_version_1_dicts_keep_their_meaning():
    """A config saved before length scaling existed used one cluster count at every length."""
    old = {
        "clusters": 25,
        "topk": 32,
        "bits": 63,
        "iterations": 10,
        "mode": "i-clustered",
        "min_length": 0,
        "seed": 0,
        "layers": None,
        "backend": "auto",
        "version": 1,
    }
    config = ClusteredAttentionConfig.from_dict(old)
    assert config.cluster_growth == 0 and config.topk_growth == 0
    assert config.row_settings(16384) == (25, 32)
    # A version-2 dict without the growths takes today's defaults (to_dict always writes them).
    assert ClusteredAttentionConfig.from_dict({**old, "version": 2}).row_settings(16384) == (141, 181)


def test_row_settings_change_nothing_up_to_512_tokens_and_grow_as_documented_after():
    config = ClusteredAttentionConfig(clusters=25, topk=32)
    for length in (1, 25, 128, 384, 512):
        assert config.row_settings(length) == (25, 32)
    # The figures of the ClusteredAttentionConfig docstring.
    assert [config.row_settings(n) for n in (1024, 2048, 8192, 16384)] == [
        (35, 45),
        (50, 64),
        (100, 128),
        (141, 181),
    ]
    assert ClusteredAttentionConfig(cluster_growth=0, topk_growth=0).row_settings(8192) == (25, 32)
    assert ClusteredAttentionConfig(cluster_growth=1, topk_growth=1).row_settings(8192) == (400, 512)
    assert ClusteredAttentionConfig(clusters=2**31 - 1, cluster_growth=1).row_settings(10**6)[0] == 2**31 - 1


def test_the_two_presets_differ_only_in_min_length():
    convert, evaluation = ClusteredAttentionConfig.for_convert(), ClusteredAttentionConfig.for_evaluation()
    assert convert.min_length == "auto" and evaluation.min_length == 0
    assert convert.replace(min_length=0) == evaluation == ClusteredAttentionConfig()
    assert ClusteredAttentionConfig.for_convert(clusters=50, layers=[2, 1]) == convert.replace(
        clusters=50, layers=(1, 2)
    )
    assert ClusteredAttentionConfig.for_evaluation(min_length=128).min_length == 128


@pytest.mark.parametrize(
    "preset", [ClusteredAttentionConfig.for_convert, ClusteredAttentionConfig.for_evaluation]
)
def test_a_preset_refuses_an_unknown_setting_naming_the_allowed_ones(preset):
    with pytest.raises(
        TypeError, match=r"unknown clustered attention setting\(s\) \['clusterz'\]; allowed: clusters"
    ):
        preset(clusterz=3)
    with pytest.raises(ValueError, match="clusters must be >= 1"):
        preset(clusters=0)


def test_the_evaluator_and_the_cli_use_the_presets():
    from bert_cluster import checkpoints, evaluation
    from bert_cluster.config import CONVERT_SETTINGS, EVALUATION_SETTINGS

    assert evaluation.EVALUATION_DEFAULTS == dict(EVALUATION_SETTINGS) == {"min_length": 0}
    assert dict(CONVERT_SETTINGS) == {"min_length": "auto"}
    assert (
        checkpoints.attention_config(None, {}, EVALUATION_SETTINGS)
        == ClusteredAttentionConfig.for_evaluation()
    )
