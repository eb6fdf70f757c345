"""benchmarks.long_context: the bf16 runs (issue 27) against the fp32 unmodified model."""

from __future__ import annotations

import pytest
import torch
import transformers

from benchmarks import long_context


def load_bench():
    return long_context


@pytest.fixture()
def tiny_bench(monkeypatch):
    """The script with its model replaced by a small random BERT (2 layers, 64 positions)."""
    bench = load_bench()
    built: list[torch.nn.Module] = []

    def build_model(name, cache, folder=None):
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=300,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        model = transformers.BertModel(config, add_pooling_layer=False).eval()
        model.config._attn_implementation = "sdpa"
        built.append(model)

        def inputs(length, document):
            generator = torch.Generator().manual_seed(document)
            return torch.randint(5, 300, (1, length), generator=generator)

        return model, inputs

    monkeypatch.setattr(bench, "build_model", build_model)
    monkeypatch.setattr(bench, "WARMUP_TOKENS", 8)
    return bench, built


def job(dtype: str) -> dict:
    return {
        "model": "minilm-l6-16k",
        "length": 48,
        "threads": 1,
        "convert": {"clusters": 4, "topk": 8, "min_length": 0},
        "documents": 2,
        "dtype": dtype,
        "mode": "time",
        "repeats": 1,
    }


def test_bf16_runs_compare_with_the_fp32_unmodified_model(tiny_bench):
    bench, built = tiny_bench
    out = bench.worker(job("bf16"))
    assert next(built[0].parameters()).dtype == torch.bfloat16  # the timed forwards ran in bf16
    assert len(out["sdpa_s"]) == len(out["patched_s"]) == 2
    # torch's own bf16 path moves the embedding from the fp32 one (by bf16 rounding, not more), and the
    # patched cosine is taken against that same fp32 embedding.
    assert len(out["sdpa_cosine"]) == len(out["cosine"]) == 2
    assert all(0.99 < c < 1.0 for c in out["sdpa_cosine"]), out["sdpa_cosine"]
    assert all(0.9 < c <= 1.0 + 1e-12 for c in out["cosine"]), out["cosine"]


def test_fp32_runs_compare_patched_with_unmodified_in_the_same_run(tiny_bench):
    bench, built = tiny_bench
    out = bench.worker(job("fp32"))
    assert next(built[0].parameters()).dtype == torch.float32
    assert "sdpa_cosine" not in out
    # float64 cosines (an fp32 one read 1.0000001 on a Zen 3): 1 up to float64 round-off at most.
    assert all(0.9 < c <= 1.0 + 1e-12 for c in out["cosine"]), out["cosine"]


def test_targets_follow_the_dtype():
    bench = load_bench()
    timing = {"sdpa_s": [10.0], "patched_s": [2.0], "cosine": [0.99], "sdpa_cosine": [0.995]}
    fp32 = bench.summarise("minilm-l6-16k", 8192, timing, {})
    bf16 = bench.summarise("minilm-l6-16k", 8192, timing, {}, "bf16")
    # 5x: issue 9's fp32 target (3.5x) is met, issue 27's bf16 target (5x) is met exactly.
    assert (fp32["target_speedup"], fp32["speedup_met"]) == (3.5, True)
    assert (bf16["target_speedup"], bf16["speedup_met"]) == (5.0, True)
    slower = bench.summarise("minilm-l6-16k", 16384, timing, {}, "bf16")
    assert (slower["target_speedup"], slower["speedup_met"]) == (8.0, False)
    assert bf16["sdpa_cosine_min"] == 0.995
    assert bench.label(bf16) == "minilm-l6-16k (bf16)" and bench.label(fp32) == "minilm-l6-16k"
