"""benchmarks.embed_memory: the corpus it generates, and its summary taken from its own runs."""

from __future__ import annotations

import json

import pytest

from benchmarks import embed_memory


def load_bench():
    return embed_memory


def test_the_corpus_is_the_same_for_the_same_seed(tmp_path):
    bench = load_bench()
    bench.make_corpus(tmp_path / "a.txt", 50)
    bench.make_corpus(tmp_path / "b.txt", 50)
    bench.make_corpus(tmp_path / "c.txt", 50, seed=1)
    lines = (tmp_path / "a.txt").read_text().splitlines()
    assert len(lines) == 50 and all(5 <= len(line.split()) <= 15 for line in lines)
    assert (
        (tmp_path / "a.txt").read_text()
        == (tmp_path / "b.txt").read_text()
        != (tmp_path / "c.txt").read_text()
    )


@pytest.mark.slow(reason="two embed runs, each in a fresh subprocess that imports torch and transformers")
def test_two_sizes_give_runs_and_a_summary_from_them(tmp_path):
    bench = load_bench()
    output = tmp_path / "results.json"
    bench.main(["--documents", "40", "20", "--shard-size", "15", "--threads", "1", "--output", str(output)])
    results = json.loads(output.read_text())
    runs = results["runs"]
    assert [(run["implementation"], run["documents"]) for run in runs] == [("current", 20), ("current", 40)]
    assert [run["documents_embedded"] for run in runs] == [20, 40] and [run["shards"] for run in runs] == [
        2,
        3,
    ]
    assert all(run["peak_rss_mib"] >= run["rss_before_embed_mib"] > 0 for run in runs)
    summary = results["summary"]
    assert summary["largest_over_smallest_peak"] == runs[1]["peak_rss_mib"] / runs[0]["peak_rss_mib"]
    assert summary["meets_targets"] == (
        runs[1]["peak_rss_mib"] < bench.PEAK_LIMIT_MIB
        and summary["largest_over_smallest_peak"] < bench.PEAK_RATIO_LIMIT
    )
