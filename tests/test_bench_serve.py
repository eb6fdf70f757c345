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


def cell(workload, concurrency, arm, rate, p50=10.0, p99=20.0, short_p99=None, errors=0):
    by_kind = {"short": {"p99": short_p99}} if short_p99 is not None else {}
    return {
        "workload": workload,
        "concurrency": concurrency,
        "arm": arm,
        "requests_per_s": rate,
        "latency_ms": {"p50": p50, "p99": p99},
        "latency_ms_by_kind": by_kind,
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
