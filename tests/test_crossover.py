"""min_length="auto": the measured crossover, its cache, and the routing it drives."""

from __future__ import annotations

import json

import pytest
import torch

from bert_cluster import ClusteredAttentionConfig, clustered_attention, crossover, dispatch
from bert_cluster import reference as R
from bert_cluster.attention import _clustered


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(crossover.CACHE_ENV, str(tmp_path))
    crossover.clear_memory()
    yield tmp_path / crossover.CACHE_FILE
    crossover.clear_memory()


def timings(*rows):
    return [{"length": n, "sdpa_s": s, "clustered_s": c} for n, s, c in rows]


def test_the_crossover_is_the_first_of_two_wins_in_a_row():
    assert crossover.crossover_from(timings((64, 1, 3), (128, 2, 3), (256, 4, 3), (384, 6, 3))) == 256
    # a single noisy win does not count
    assert crossover.crossover_from(timings((64, 1, 0.5), (128, 2, 3), (256, 4, 3), (384, 6, 3))) == 256
    # within MARGIN (0.75) is not a win
    assert crossover.MARGIN == 0.75
    assert crossover.crossover_from(timings((256, 4, 3.8), (384, 6, 4.6), (512, 9, 5))) == 512
    # never won: extrapolated from the last ratio (2 at 512 -> 512 * 2 / 0.75)
    assert crossover.crossover_from(timings((256, 1, 3), (512, 4, 8))) == 1366
    assert crossover.crossover_from([]) == 0


def q_k_v(heads=2, n=16, dk=8, dv=8):
    return torch.randn(1, heads, n, dk), torch.randn(1, heads, n, dk), torch.randn(1, heads, n, dv)


def test_measured_once_then_read_from_the_cache_file(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(
        crossover, "measure", lambda *a: calls.append(1) or {"min_length": 300, "timings": []}
    )
    backend = dispatch.ReferenceBackend()
    q, k, v = q_k_v()
    config = ClusteredAttentionConfig(min_length="auto")
    assert crossover.min_length(backend, q, k, v, config, 0.5, _clustered) == 300
    assert crossover.min_length(backend, q, k, v, config, 0.5, _clustered) == 300
    assert len(calls) == 1
    crossover.clear_memory()  # a new process: reads the file
    assert crossover.min_length(backend, q, k, v, config, 0.5, _clustered) == 300 and len(calls) == 1
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["facts"]["backend"] == "reference" and entry["facts"]["heads"] == 2
    assert entry["facts"]["threads"] == torch.get_num_threads() and entry["facts"]["dtype"] == "float32"
    # What the crossover depends on is its key: another head dim, dtype or setting measures again.
    crossover.min_length(backend, *q_k_v(dk=16), config, 0.5, _clustered)
    crossover.min_length(backend, *(t.bfloat16() for t in q_k_v()), config, 0.5, _clustered)
    crossover.min_length(backend, q, k, v, config.replace(clusters=50), 0.5, _clustered)
    assert len(calls) == 4 and len(json.loads(cache.read_text())) == 4


def test_an_unwritable_cache_folder_keeps_the_figure_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(crossover.CACHE_ENV, str(blocker / "sub"))
    crossover.clear_memory()
    calls = []
    monkeypatch.setattr(crossover, "measure", lambda *a: calls.append(1) or {"min_length": 7, "timings": []})
    q, k, v = q_k_v()
    for _ in range(2):
        assert (
            crossover.min_length(
                dispatch.ReferenceBackend(), q, k, v, ClusteredAttentionConfig(), 0.5, _clustered
            )
            == 7
        )
    assert len(calls) == 1
    crossover.clear_memory()


def test_a_noisy_measurement_is_used_but_not_cached(cache, monkeypatch):
    calls = []
    noisy = {"min_length": 900, "stable": False, "timings": []}
    monkeypatch.setattr(crossover, "measure", lambda *a: calls.append(1) or noisy)
    q, k, v = q_k_v()
    assert (
        crossover.min_length(
            dispatch.ReferenceBackend(), q, k, v, ClusteredAttentionConfig(), 0.5, _clustered
        )
        == 900
    )
    assert not cache.exists()
    crossover.clear_memory()  # the next process measures again
    crossover.min_length(dispatch.ReferenceBackend(), q, k, v, ClusteredAttentionConfig(), 0.5, _clustered)
    assert len(calls) == 2


def test_a_real_measurement_is_quick_and_well_formed(cache, monkeypatch):
    monkeypatch.setattr(crossover, "BUDGET_S", 0.3)
    q, k, v = q_k_v(heads=1, dk=4, dv=4)
    result = crossover.measure(
        dispatch.ReferenceBackend(), q, k, v, ClusteredAttentionConfig(clusters=4), 0.5, _clustered
    )
    assert result["timings"] and result["seconds"] < 10
    assert result["min_length"] == crossover.crossover_from(result["timings"]) >= 0
    assert all(t["sdpa_s"] > 0 and t["clustered_s"] > 0 and t["spread"] >= 1 for t in result["timings"])
    assert result["stable"] == all(t["spread"] <= crossover.STABLE_SPREAD for t in result["timings"])


def test_auto_routes_rows_below_the_crossover_to_exact_attention(cache, monkeypatch):
    monkeypatch.setattr(crossover, "min_length", lambda *a: 50)
    q, k, v = (torch.randn(2, 2, 70, 8) for _ in range(3))
    valid = torch.ones(2, 70, dtype=torch.bool)
    valid[0, 40:] = False  # 40 valid: below 50, exact
    config = ClusteredAttentionConfig(clusters=4, topk=3, min_length="auto", backend="reference")
    out = clustered_attention(q, k, v, valid, config, scaling=0.5)
    exact = R.exact_attention(q, k, v, valid, 0.5)
    assert (out[0] - exact[0]).abs().max() < 2e-6  # measured 3e-7
    assert (out[1] - exact[1]).abs().max() > 1e-2  # 70 valid: clustered


def test_convert_defaults_to_auto_and_short_rows_match_the_unmodified_model(cache, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import bert_cluster

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(5, 100, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with torch.inference_mode():
        before = model(input_ids=ids, attention_mask=mask).last_hidden_state
    bert_cluster.convert(model, clusters=4, topk=3)
    assert model.config.clustered_attention["min_length"] == "auto"
    # As measured on the CPU kernels at this size (a crossover of a few hundred tokens), fixed here.
    monkeypatch.setattr(crossover, "measure", lambda *a: {"min_length": 200, "timings": []})
    with torch.inference_mode():
        after = model(input_ids=ids, attention_mask=mask).last_hidden_state
    # Rows of 48 and 30 tokens are below the crossover: SDPA over their valid keys, as unmodified.
    # measured max difference 4.8e-7 (SDPA over the packed valid keys vs over the padded row)
    assert (after[0] - before[0]).abs().max() < 1e-5 and (after[1, :30] - before[1, :30]).abs().max() < 1e-5
    bert_cluster.convert(model, clusters=4, topk=3, min_length=0)
    with torch.inference_mode():
        approx = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (approx[0] - before[0]).abs().max() > 1e-5  # measured 9.7e-5 (a tiny random model)
