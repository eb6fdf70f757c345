"""The one report writer: evaluate's, tune's and inspect's reports come out the same way."""

from __future__ import annotations

import json

import pytest

from bert_cluster import inspection, reports
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.evaluation import report, tuner
from bert_cluster.evaluation.report import Results, RunResult, TaskResult


@pytest.fixture(scope="module")
def environment():
    return reports.environment("cpu")


def results(environment) -> Results:
    task = TaskResult("rte", "classification", 1, model="m", source="dev.tsv", examples=4)
    task.metrics = [("accuracy", "acc")]
    task.runs = [
        RunResult(None, None, {"accuracy": 75.0}, 1.0, 4.0, 100.0, 1.0, "sdpa"),
        RunResult(2, 0, {"accuracy": 50.0}, 0.5, 8.0, 200.0, 2.0, "reference", "i-clustered"),
    ]
    return Results([task], {"modes": ["i-clustered"], "seeds": [0]}, environment, "now")


def tuned(environment, chosen: bool = True) -> tuner.TuneResult:
    base = RunResult(None, None, {"accuracy": 75.0}, 1.0, 4.0)
    run = RunResult(2, 0, {"accuracy": 75.0}, 0.5, 8.0, speedup=2.0, mode="i-clustered")
    candidate = tuner.Candidate(
        ClusteredAttentionConfig(clusters=2, topk=4), "grid", "in budget", {"accuracy": 0.0}, 2.0, 0.3, [run]
    )
    return tuner.TuneResult(
        task="rte",
        model="m",
        budget=0.5,
        metrics=[("accuracy", "acc")],
        cost="attention",
        unmodified=base,
        candidates=[candidate],
        chosen=candidate if chosen else None,
        examples=4,
        screen_examples=None,
        mean_length=20.0,
        settings={"clusters": [2]},
        environment=environment,
        started="now",
    )


def inspected() -> inspection.Inspection:
    heads = [
        inspection.HeadReport(layer, head, 0.05 * (layer + 1), 0.5, 3.0, 4.0, 0.3, 2)
        for layer in range(2)
        for head in range(2)
    ]
    return inspection.Inspection(ClusteredAttentionConfig(clusters=3), sequences=2, tokens=30, heads=heads)


def test_evaluate_tune_and_inspect_write_json_markdown_and_plot_with_the_run_metadata(environment, tmp_path):
    written = {
        "results": report.write(results(environment), tmp_path / "evaluate"),
        "tune": tuner.write(tuned(environment), tmp_path / "tune"),
        "inspect": inspection.write(inspected(), tmp_path / "inspect", model="m", max_error=0.1),
    }
    plots = {"results": "scores.png", "tune": "tune.png", "inspect": "inspect.png"}
    for stem, files in written.items():
        folder = next(iter(files.values())).parent
        expected = {f"{stem}.json", f"{stem}.md", plots[stem]} | (
            {"clustered-attention.json"} if stem == "tune" else set()
        )
        assert set(files) == expected == {path.name for path in folder.iterdir()}, stem
        document = json.loads((folder / f"{stem}.json").read_text())
        assert document["files"] == sorted(expected)
        recorded = document["environment"]
        assert {"packages", "hardware", "git", "date"} <= set(recorded), stem
        assert recorded["git"] == environment["git"], stem  # inspect records its own environment()
        assert recorded["packages"]["torch"] and recorded["packages"]["transformers"], stem
        section = "\n".join(reports.metadata_markdown(document["settings"], recorded))
        assert (folder / f"{stem}.md").read_text().endswith(section), stem
        assert (folder / plots[stem]).read_bytes()[:4] == b"\x89PNG", stem
    inspected_document = json.loads((tmp_path / "inspect" / "inspect.json").read_text())
    assert inspected_document["settings"]["config"] == ClusteredAttentionConfig(clusters=3).to_dict()
    assert inspected_document["suggested_layers"] == [0, 1] and inspected_document["model"] == "m"
    markdown = (tmp_path / "inspect" / "inspect.md").read_text()
    assert "| layer | rel. error | worst head |" in markdown and "| 1 | 1 | 0.1000 |" in markdown


def test_a_report_without_its_metadata_is_refused(environment, tmp_path):
    files = reports.ReportFiles("x.json", "x.md")
    with pytest.raises(ValueError, match="missing environment"):
        reports.write_report(tmp_path, files, {"settings": {}}, "text")
    with pytest.raises(ValueError, match="missing environment.hardware, environment.git, environment.date"):
        reports.write_report(tmp_path, files, {"settings": {}, "environment": {"packages": {}}}, "text")
    with pytest.raises(ValueError, match="not among this report's files"):
        document = {"settings": {}, "environment": environment}
        reports.write_report(tmp_path, files, document, "text", extra={"other.json": "{}"})
    assert list(tmp_path.iterdir()) == []


def test_a_later_report_removes_only_the_stale_files_of_its_own_kind(environment, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    report.write(results(environment), tmp_path)
    tuner.write(tuned(environment), tmp_path)
    assert (tmp_path / "clustered-attention.json").is_file()
    tuner.write(tuned(environment, chosen=False), tmp_path)  # no settings chosen: the old choice goes
    inspection.write(inspected(), tmp_path, model="m")
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "inspect.json",
        "inspect.md",
        "inspect.png",
        "notes.txt",
        "results.json",
        "results.md",
        "scores.png",
        "tune.json",
        "tune.md",
        "tune.png",
    ]
