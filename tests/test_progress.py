"""Progress that tells the truth: an ETA weighted by tokens, and an embed bar whose time left is never cut."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from bert_cluster.embedding.progress import ProgressBar
from bert_cluster.parallel import Workers
from bert_cluster.render import LogReporter


class FakeClock:
    """Seconds that pass only when a batch runs: one per 1,000 tokens."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_eta_at_ten_percent_is_within_2x_of_the_time_really_left(monkeypatch):
    """Items of very unequal length (as SQuAD's windows against short questions): the longest run first."""
    clock = FakeClock()
    monkeypatch.setattr("bert_cluster.parallel.time.perf_counter", clock)
    lengths = [512] * 20 + [12] * 488  # 508 items, as the demo's pass
    out = io.StringIO()
    reporter = LogReporter(Console(file=out, width=300), every=0.0, clock=clock)
    reporter.task("demo", 1)
    reporter.configuration("i-clustered+ C=25 seed=0")
    clock.now += 5.0  # converting the model: before the pass, not part of its pace

    def run(batch: list[int]) -> list[int]:
        clock.now += sum(lengths[item] for item in batch) / 1000
        return batch

    reports = []

    def advance(done: int, total: int, *tokens: int) -> None:
        reporter.advance(done, total, *tokens)
        reports.append((done, total, clock.now))

    Workers().map(run, list(range(len(lengths))), lengths, batch_size=4, advance=advance)
    end = clock.now
    lines = [line for line in out.getvalue().splitlines() if "ETA" in line]
    first = next(index for index, (done, total, _) in enumerate(reports[1:]) if done >= total / 10)
    done, total, at = reports[first + 1]
    eta = float(re.search(r"ETA (\d+) s", lines[first]).group(1))
    assert f"{done}/{total}" in lines[first]
    really_left = end - at
    assert really_left / 2 <= eta <= really_left * 2, (lines[first], really_left)


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_embed_bar_never_cuts_the_time_left(width):
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    clock = FakeClock()
    bar = ProgressBar(console, clock=clock)
    with bar:
        bar(0, 0, 56_789, 9_876_543)
        clock.now = 3_725.0
        bar(2_345, 2_234_567, 56_789, 9_876_543)
    last = out.getvalue().split("\r")[-1]
    assert "…" not in last, last
    assert "3:32:19 left" in last, last  # 3,725 s for 22.6% of the tokens: 12,739 s more
