"""benchmarks.linears: the linear layers' floor under a patched model's time (issue 27, item 2)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from benchmarks import linears


def load_bench():
    return linears


def tiny_bert() -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config).eval()


def test_only_the_encoders_linear_layers_are_timed_in_order():
    bench = load_bench()
    linears = bench.encoder_linears(tiny_bert())
    # Per layer: query, key, value, attention output, intermediate, output; the pooler is left out.
    assert [(layer.in_features, layer.out_features) for layer in linears] == [
        (32, 32),
        (32, 32),
        (32, 32),
        (32, 32),
        (32, 64),
        (64, 32),
    ] * 2


@pytest.mark.parametrize(("unmodified_s", "target", "within"), [(1e6, 5.0, True), (1e-9, 5.0, False)])
def test_the_bound_is_the_unmodified_time_over_the_linear_layers_time(
    monkeypatch, tmp_path, unmodified_s, target, within
):
    bench = load_bench()
    monkeypatch.setattr(bench, "build_model", lambda name, cache: (tiny_bert(), None))
    measured = tmp_path / "long.json"
    row = {"model": "minilm-l6-16k", "length": 16, "dtype": "fp32", "sdpa_s": unmodified_s}
    row |= {"speedup": 1.5, "target_speedup": target}
    measured.write_text(json.dumps({"rows": [row]}), encoding="utf-8")
    output = tmp_path / "linears.json"
    args = ["--lengths", "16", "--repeats", "2", "--threads", "1", "--long-context", str(measured)]
    assert bench.main([*args, "--output", str(output)]) == 0
    (result,) = json.loads(output.read_text(encoding="utf-8"))["rows"]
    assert result["layers"] == 12
    assert result["gflop"] == pytest.approx(2 * 16 * (4 * 32 * 32 + 2 * 32 * 64) * 2 / 1e9)
    assert len(result["raw_s"]) == 2 and result["linears_s"] > 0
    assert result["bound"] == pytest.approx(unmodified_s / result["linears_s"])
    assert result["target_within_bound"] is within


def test_a_results_file_of_another_dtype_gives_no_bound(monkeypatch, tmp_path):
    bench = load_bench()
    monkeypatch.setattr(bench, "build_model", lambda name, cache: (tiny_bert(), None))
    measured = tmp_path / "long.json"
    row = {"model": "minilm-l6-16k", "length": 16, "dtype": "bf16", "sdpa_s": 1.0, "target_speedup": 5.0}
    measured.write_text(json.dumps({"rows": [row]}), encoding="utf-8")
    output = tmp_path / "linears.json"
    args = ["--lengths", "16", "--repeats", "1", "--long-context", str(measured), "--output", str(output)]
    assert bench.main(args) == 0
    (result,) = json.loads(output.read_text(encoding="utf-8"))["rows"]
    assert "bound" not in result
