"""benchmarks.harness: the timing rounds' order, the environment a run records, how a benchmark starts a
child of itself (from any folder, no ``sys.path`` edit), and the Markdown the tables are made of."""

from __future__ import annotations

import os

import pytest

from benchmarks import harness


def recorder(calls: list[str], name: str):
    return lambda: calls.append(name)


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("interleaved", ["a", "b", "c"] * 3),
        ("alternating", ["a", "b", "c", "c", "b", "a", "a", "b", "c"]),
        ("blocked", ["a"] * 3 + ["b"] * 3 + ["c"] * 3),
    ],
)
def test_time_rounds_runs_the_calls_in_the_order_asked(order, expected):
    calls: list[str] = []
    synced: list[str] = []
    times = harness.time_rounds(
        {name: recorder(calls, name) for name in "abc"}, 3, order, sync=lambda: synced.append("sync")
    )
    assert calls == expected
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(s >= 0 for seconds in times.values() for s in seconds)
    assert len(synced) == 2 * len(expected)  # before and after every call


def test_time_rounds_refuses_an_unknown_order():
    with pytest.raises(
        ValueError, match="order must be one of interleaved, alternating, blocked, got 'random'"
    ):
        harness.time_rounds({"a": lambda: None}, 1, "random")


def test_the_environment_is_the_packages_report_with_the_tables_facts_on_top():
    import torch

    from bert_cluster import reports

    found = harness.environment(threads=3)
    assert set(reports.environment()) <= set(found)  # packages, hardware, kernels, git, date
    assert found["threads"] == 3 and found["processor"] == found["hardware"]["cpu"]
    assert found["torch"] == str(torch.__version__)
    assert set(harness.KERNEL_FACTS) <= set(found) and found["torch_cpu_capability"]
    assert found["date"][:2] == "20"


def test_package_versions_name_only_what_is_installed():
    found = harness.package_versions(["pyyaml", "no-such-package-here"])
    assert set(found) == {"python", "pyyaml"}


def test_a_worker_child_finds_the_benchmarks_from_any_folder(tmp_path, monkeypatch):
    """``python -m benchmarks.NAME --worker`` with the root on PYTHONPATH: it starts from another folder,
    gives its JSON line back, and an error in it is one line, not an exception here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    versions = harness.run_worker("benchmarks.peers", {"mode": "versions"}, timeout=120)
    assert versions["python"] and "error" not in versions
    failed = harness.run_worker("benchmarks.peers", {"mode": "measure"}, timeout=120)
    assert set(failed) == {"error"} and "KeyError" in failed["error"]
    env = harness.module_env(EXTRA="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(harness.ROOT) and env["EXTRA"] == "1"


def test_table_lines_align_columns_and_escape_pipes():
    lines = harness.table_lines(["a", "b"], "lr", [["x|y", "1"]])
    assert lines == ["| a | b |", "|---|---:|", "| x\\|y | 1 |"]


def test_each_long_input_document_starts_at_another_article():
    articles = harness.squad_articles()
    assert len(articles) == 48
    first, second = (harness.joined_articles(articles, d) for d in (0, 1))
    assert first.startswith(articles[0]) and second.startswith(articles[7])
    assert len(first) == len(second)  # every article, once each
