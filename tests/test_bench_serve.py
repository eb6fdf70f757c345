"""benchmarks/serve.py's own logic: the inputs' lengths, the percentiles, the targets' verdicts."""

from __future__ import annotations

import pytest

from benchmarks import serve as bench


@pytest.fixture(scope="module")
def texts(minilm_dir):
    return bench.Texts(str(minilm_dir), seed=3)


def test_inputs_have_the_lengths_asked_for(texts):
    shorts = texts.workload("short", 40)
    assert all(bench.SHORT_TOKENS[0] - 1 <= text.tokens <= bench.SHORT_TOKENS[1] for text in shorts)
    assert len({text.text for text in shorts}) == 40
    for length in (64, 2048):
        (document,) = texts.workload(f"long-{length}", 1)
        assert length - 3 <= document.tokens <= length  # cut at a whole token, never past it
    mix = texts.workload("mix", 50)
    assert sum(text.kind == "long-8192" for text in mix) == 5


def test_the_same_seed_gives_the_same_inputs(minilm_dir):
    first, second = (bench.Texts(str(minilm_dir), seed=5).workload("mix", 20) for _ in range(2))
    assert first == second
    assert first != bench.Texts(str(minilm_dir), seed=6).workload("mix", 20)


def test_percentiles_are_nearest_rank_in_milliseconds():
    found = bench.percentiles([i / 1000 for i in range(1, 101)])
    assert found == {"p50": 50.0, "p95": 95.0, "p99": 99.0, "n": 100}
    assert bench.percentiles([]) is None


def cell(
    workload, concurrency, arm, rate, p50=10.0, p99=20.0, short_p99=None, errors=0, seconds=None, counts=None
):
    by_kind = {"short": {"p99": short_p99}} if short_p99 is not None else {}
    if counts is not None:
        by_kind["short"]["n"] = counts[0]
        by_kind["long-8192"] = {"p50": 5000.0, "n": counts[1]}
    return {
        "workload": workload,
        "concurrency": concurrency,
        "arm": arm,
        "requests_per_s": rate,
        "latency_ms": {"p50": p50, "p99": p99},
        "latency_ms_by_kind": by_kind,
        "seconds": seconds,
        "errors": errors,
        "deliberate_429": 0,
    }


def test_targets_are_marked_met_or_missed_for_every_arm():
    cells = [
        cell("long-8192", 1, "clustered", 0.3, p50=3000),
        cell("long-8192", 1, "exact", 0.1, p50=10000),
        cell("long-8192", 1, "infinity", 0.1, p50=10000),
        cell("long-8192", 4, "clustered", 0.29),
        cell("long-8192", 4, "exact", 0.1),
        cell("long-8192", 4, "infinity", 0.1),
        cell("short", 8, "clustered", 95, p99=100),
        cell("short", 8, "exact", 80, p99=100),
        cell("short", 8, "infinity", 100, p99=100),
        cell("mix", 8, "clustered", 10, short_p99=3100),  # bound: 3,000 + 2 x 100
        cell("mix", 8, "exact", 10, short_p99=10300),  # bound: 10,000 + 2 x 100
        cell("mix", 8, "infinity", 10, short_p99=10100, errors=2),
    ]
    found = bench.targets(cells)
    long = found["long_8192_vs_infinity"]["arms"]
    assert long["clustered"]["met"] is False  # 3.0x at 1, 2.9x at 4: every level must reach 3x
    assert long["clustered"]["ratios"] == pytest.approx({"1": 3.0, "4": 2.9})
    assert long["exact"]["met"] is False
    short = found["short_vs_infinity"]["arms"]
    assert short["clustered"]["met"] is True and short["exact"]["met"] is False
    mix = found["mix_short_p99"]
    assert mix["clustered"]["met"] is True and mix["exact"]["met"] is False and mix["infinity"]["met"] is True
    assert mix["clustered"]["levels"]["8"]["bound_ms"] == 3200
    assert found["no_errors"]["infinity"] == {"errors": 2, "deliberate_429": 0, "met": False}
    assert found["no_errors"]["clustered"]["met"] is True


def test_the_interleave_controls_are_this_server_without_interleaving_and_get_the_mix_bound():
    arms = bench.make_arms("MODEL", 2, "infinity_emb", ("clustered", "clustered-no-interleave"))
    assert [arm.name for arm in arms] == ["clustered", "clustered-no-interleave"]
    assert "--no-interleave" not in arms[0].command and "--no-interleave" in arms[1].command
    assert all(arm.command[-2:] == ["--port", str(arm.port)] for arm in arms)
    cells = [
        cell("long-8192", 1, "clustered", 0.6, p50=1600),
        cell("long-8192", 1, "clustered-no-interleave", 0.6, p50=1550),
        cell("short", 8, "clustered", 100, p99=100),
        cell("short", 8, "clustered-no-interleave", 100, p99=110),
        cell("mix", 8, "clustered", 10, short_p99=400, seconds=90, counts=(45, 9)),  # 1,600 + 2 x 100
        cell("mix", 8, "clustered-no-interleave", 10, short_p99=1900),  # bound: 1,550 + 2 x 110
    ]
    found = bench.targets(cells)
    assert list(found["mix_short_p99"]) == ["clustered", "clustered-no-interleave"]
    assert found["mix_short_p99"]["clustered"]["met"] is True
    assert found["mix_short_p99"]["clustered-no-interleave"]["levels"]["8"]["bound_ms"] == 1770
    assert found["mix_short_p99"]["clustered-no-interleave"]["met"] is False
    report = {
        "cells": cells,
        "targets": found,
        "threads": 2,
        "rounds": 2,
        "machine": {"cpu": "CPU", "cores": 2},
        "load_average_before": [1.0, 1.0, 1.0],
        "load_average_after": [2.0, 2.0, 2.0],
        "date": "2026-12-08T00:00:00",
    }
    lines = bench.interleave_table([report])
    rows = [
        [part.strip() for part in line.split("|")[1:-1]] for line in lines if line.startswith("| clustered")
    ]
    assert [row[:2] for row in rows] == [["clustered", "8"], ["clustered-no-interleave", "8"]]
    assert [row[7] for row in rows] == ["met", "missed"]
    assert rows[1][5:7] == ["1,900", "1,770"]
    assert rows[0][2] == "0.5" and rows[0][3] == "0.1"  # 45 queries and 9 documents in 90 s
