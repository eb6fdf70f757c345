"""benchmarks.attention: the order in which the timed calls run."""

from __future__ import annotations

import argparse
import sys

import pytest

from benchmarks import attention

THREE_EACH = {("sdpa", 64): 3, ("kernel-i-clustered", 64): 3}


def load_bench():
    return attention


@pytest.fixture()
def bench(monkeypatch):
    bench_attention = load_bench()
    calls: list[str] = []
    monkeypatch.setattr(bench_attention, "make_call", lambda method, *args: lambda: calls.append(method))
    return bench_attention, calls


def run(bench_attention, order: str) -> dict:
    args = argparse.Namespace(
        methods=["sdpa", "kernel-i-clustered"],
        max_reference_n=4096,
        heads=2,
        head_dim=8,
        device="cpu",
        dtype="fp32",
        batch=1,
        mixed=False,
        growth=False,
        threads=1,
        repeats=3,
        order=order,
    )
    times, _ = bench_attention.time_all([64], args)
    return times


def test_interleaved_runs_every_method_once_per_round(bench):
    bench_attention, calls = bench
    times = run(bench_attention, "interleaved")
    warm_up = ["sdpa", "kernel-i-clustered"]
    assert calls == warm_up + ["sdpa", "kernel-i-clustered"] * 3
    assert {key: len(value) for key, value in times.items()} == THREE_EACH


def test_blocked_runs_each_methods_repeats_back_to_back(bench):
    bench_attention, calls = bench
    times = run(bench_attention, "blocked")
    warm_up = ["sdpa", "kernel-i-clustered"]
    assert calls == warm_up + ["sdpa"] * 3 + ["kernel-i-clustered"] * 3
    assert {key: len(value) for key, value in times.items()} == THREE_EACH


def test_no_repeats_is_refused(monkeypatch, capsys):
    bench_attention = load_bench()
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--repeats", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main()
    assert exit_info.value.code == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_growth_takes_converts_growth_of_clusters_and_topk():
    from bert_cluster import ClusteredAttentionConfig

    bench_attention = load_bench()
    fixed = ClusteredAttentionConfig(**bench_attention.clustered_settings(False))
    grown = ClusteredAttentionConfig(**bench_attention.clustered_settings(True))
    settings = bench_attention.SETTINGS
    assert fixed.row_settings(4096) == (settings["clusters"], settings["topk"])
    assert grown.row_settings(4096) == ClusteredAttentionConfig().row_settings(4096)
    assert grown.row_settings(4096) != fixed.row_settings(4096)
    assert grown.row_settings(512) == fixed.row_settings(512)  # growth starts above 512 tokens
