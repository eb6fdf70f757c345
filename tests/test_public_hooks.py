"""The package's public hooks for its benchmarks (issue 70): what a benchmark needs, without private names.

``attention.replaced_steps`` runs candidate steps in place of the paper's (``benchmarks.fidelity_screen``);
``crossover.stored`` reads the min_length="auto" figures a benchmark records (``benchmarks.model``).
"""

from __future__ import annotations

import json

import pytest
import torch

from bert_cluster import ClusteredAttentionConfig, attention, clustered_attention, crossover

CONFIG = ClusteredAttentionConfig(clusters=2, topk=2, min_length=0, backend="reference")


def inputs(lengths: tuple[int, ...] = (12, 12)) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(lengths), 2, max(lengths), 4, generator=generator) for _ in range(3))
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return q, k, v, valid


def test_replaced_steps_run_in_place_of_the_papers_steps_within_the_block():
    q, k, v, valid = inputs()
    seen = []

    def steps(backend, query, key, value, valid, config, clusters, topk, scaling, layer):
        seen.append((backend.name, tuple(query.shape), clusters, topk, layer))
        return torch.full((*query.shape[:-1], value.shape[-1]), 7.0)

    before = clustered_attention(q, k, v, valid, CONFIG)
    with attention.replaced_steps(steps):
        replaced = clustered_attention(q, k, v, valid, CONFIG, layer=3)
    assert seen == [("reference", (2, 2, 12, 4), 2, 2, 3)]
    assert torch.equal(replaced, torch.full_like(replaced, 7.0))
    assert torch.equal(clustered_attention(q, k, v, valid, CONFIG), before)  # the steps are back


def test_replaced_steps_leave_short_rows_exact_and_refuse_dropout():
    q, k, v, valid = inputs((12, 2))  # the second row has no more tokens than C: exact attention
    with attention.replaced_steps(lambda *args: torch.zeros(1, 2, 12, 4)):
        out = clustered_attention(q, k, v, valid, CONFIG)
        assert torch.equal(out[0], torch.zeros(2, 12, 4))
        assert torch.equal(out[1:], clustered_attention(q[1:], k[1:], v[1:], valid[1:], CONFIG))
        with pytest.raises(ValueError, match="run without attention dropout"):
            clustered_attention(q, k, v, valid, CONFIG, dropout=0.1)


def constant(value: float):
    """Steps that give every clustered row ``value``."""
    return lambda *args: torch.full((2, 2, 12, 4), value)


def test_replaced_steps_nest_and_are_restored_after_an_error():
    q, k, v, valid = inputs()
    with attention.replaced_steps(constant(1.0)):
        with pytest.raises(RuntimeError), attention.replaced_steps(constant(2.0)):
            assert clustered_attention(q, k, v, valid, CONFIG).eq(2.0).all()
            raise RuntimeError("a failed candidate")
        assert clustered_attention(q, k, v, valid, CONFIG).eq(1.0).all()
    assert not clustered_attention(q, k, v, valid, CONFIG).eq(1.0).all()


def test_stored_reads_the_figures_of_the_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv(crossover.CACHE_ENV, str(tmp_path))
    assert crossover.stored() == {}  # no file yet
    stored = {
        '{"backend": "cpu"}': {"min_length": 384, "facts": {}},
        '{"backend": "cuda"}': {"min_length": 0},
        '{"broken": 1}': {"min_length": "many"},
        '{"broken": 2}': {"timings": []},
        '{"broken": 3}': 7,
    }
    (tmp_path / crossover.CACHE_FILE).write_text(json.dumps(stored))
    assert crossover.stored() == {'{"backend": "cpu"}': 384, '{"backend": "cuda"}': 0}
    (tmp_path / crossover.CACHE_FILE).write_text("{not json")
    assert crossover.stored() == {}
