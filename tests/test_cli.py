"""The CLI through typer's runner: the API is patched where only the shell is under test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bert_cluster.cli import app
from bert_cluster.evaluation.report import Results, RunResult, TaskResult

_spec = importlib.util.spec_from_file_location(
    "bc_eval_tiny", Path(__file__).parent / "evaluation" / "tiny.py"
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

runner = CliRunner()


def fake_results(failed: bool = False) -> Results:
    task = TaskResult(
        task="rte",
        kind="classification",
        version=1,
        model="m",
        source="/d/RTE/dev.tsv",
        examples=277,
        metrics=[("accuracy", "acc")],
    )
    task.runs = [
        RunResult(None, None, {"accuracy": 60.0}, 1.0, 277.0),
        RunResult(25, 0, {"accuracy": 59.0}, 2.0, 138.5),
        RunResult(25, 1, {"accuracy": 61.0}, 2.0, 138.5),
    ]
    tasks = [task]
    if failed:
        tasks.append(
            TaskResult(
                task="mrpc",
                kind="classification",
                version=1,
                status="failed",
                error="no data file for task mrpc (looked at: /x/MRPC/dev.tsv)",
            )
        )
    return Results(
        tasks=tasks,
        settings={"mode": "i-clustered", "seeds": [0, 1], "clusters": [25]},
        environment={},
        started="now",
    )


@pytest.fixture
def patched(monkeypatch):
    calls = []

    def fake_run(model, **kwargs):
        calls.append((model, kwargs))
        return fake_results(failed=kwargs["tasks"] == "rte,mrpc")

    monkeypatch.setattr("bert_cluster.evaluation.run", fake_run)
    return calls


def test_evaluate_passes_options_to_the_api_and_renders_a_table(patched, tmp_path):
    result = runner.invoke(
        app,
        [
            "evaluate",
            "some/model",
            "--task",
            "rte",
            "--clusters",
            "10,25",
            "--seeds",
            "2",
            "--data-dir",
            str(tmp_path),
            "--data-dir",
            "b",
            "--limit",
            "64",
            "--topk",
            "16",
            "--mode",
            "clustered",
            "--batch-size",
            "8",
            "--max-length",
            "128",
        ],
    )
    assert result.exit_code == 0, result.output
    model, kwargs = patched[0]
    assert model == "some/model"
    assert kwargs["tasks"] == "rte" and kwargs["clusters"] == "10,25" and kwargs["seeds"] == 2
    assert kwargs["data_dir"] == [tmp_path, Path("b")] and kwargs["limit"] == 64 and kwargs["topk"] == 16
    assert kwargs["mode"] == "clustered" and kwargs["batch_size"] == 8 and kwargs["max_length"] == 128
    assert "60.00" in result.stdout and "60.00 ± 1.41 (+0.00)" in result.stdout
    assert "read /d/RTE/dev.tsv" in result.stdout


def test_evaluate_json_and_a_failed_task(patched):
    result = runner.invoke(app, ["evaluate", "m", "--task", "rte,mrpc", "--json"])
    assert result.exit_code == 2
    document = json.loads(result.stdout)
    assert [t["status"] for t in document["tasks"]] == ["ok", "failed"]
    assert (
        result.stderr.strip() == "error: task mrpc: no data file for task mrpc (looked at: /x/MRPC/dev.tsv)"
    )


def test_no_model_runs_the_embedded_default(patched):
    result = runner.invoke(app, ["evaluate", "--json"])
    assert result.exit_code == 0 and patched[0][0] is None and patched[0][1]["tasks"] is None


def one_line_error(result, pattern: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_user_errors_are_one_line_and_exit_2(tmp_path, tiny_folder):
    one_line_error(
        runner.invoke(app, ["evaluate", str(tiny_folder), "--task", "rte,nope"]), "unknown task(s) nope"
    )
    one_line_error(
        runner.invoke(app, ["evaluate", str(tiny_folder), "--task", "rte", "--clusters", "10,x"]),
        "malformed cluster list",
    )
    one_line_error(
        runner.invoke(app, ["evaluate", str(tmp_path / "gone"), "--task", "rte"]), "does not exist"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = runner.invoke(app, ["evaluate", str(tiny_folder), "--task", "rte", "--data-dir", str(empty)])
    one_line_error(missing, f"looked at: {empty}/RTE/dev.tsv")


def test_head_and_label_mismatches_exit_2(tmp_path, tiny_folder):
    tiny.write_rte(tmp_path / "data", tiny.RTE_ROWS)
    qa = tiny.save_model(tmp_path / "qa", head="qa", labels=None)
    one_line_error(
        runner.invoke(app, ["evaluate", str(qa), "-t", "rte", "--data-dir", str(tmp_path / "data")]),
        "no trained sequence-classification head",
    )
    wrong = tiny.save_model(tmp_path / "wrong", labels=("negative", "positive"))
    one_line_error(
        runner.invoke(app, ["evaluate", str(wrong), "-t", "rte", "--data-dir", str(tmp_path / "data")]),
        "do not match",
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny.save_model(tmp_path_factory.mktemp("cli") / "cls")


def test_convert_saves_a_patched_checkpoint(tmp_path, tiny_folder):
    result = runner.invoke(
        app,
        ["convert", str(tiny_folder), str(tmp_path / "out"), "--clusters", "3", "--topk", "4", "--seed", "7"],
    )
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["clustered_attention"]["clusters"] == 3 and config["clustered_attention"]["seed"] == 7
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    one_line_error(
        runner.invoke(app, ["convert", str(tiny_folder), str(tmp_path / "o2"), "--clusters", "0"]),
        "clusters must be",
    )
    one_line_error(
        runner.invoke(app, ["convert", str(tiny_folder), str(tmp_path / "o3"), "--layers", "0,a"]),
        "malformed layer list",
    )


def test_ls_and_validate():
    listed = runner.invoke(app, ["ls", "--json"])
    assert listed.exit_code == 0
    names = {task["name"] for task in json.loads(listed.stdout)}
    assert {
        "cola",
        "sst2",
        "mrpc",
        "qqp",
        "stsb",
        "mnli",
        "mnli_mismatched",
        "qnli",
        "rte",
        "wnli",
        "squad",
        "squad_v2",
    } <= names
    valid = runner.invoke(app, ["validate"])
    assert valid.exit_code == 0 and "valid" in valid.stdout


def test_validate_reports_a_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkind: nosuchkind\nversion: 1\n")
    one_line_error(runner.invoke(app, ["validate", str(bad)]), "unknown kind 'nosuchkind'")


def test_info_prints_build_information():
    result = runner.invoke(app, ["info", "--json"])
    if result.exit_code == 2:
        assert "build information is not available" in result.stderr
    else:
        assert result.exit_code == 0, result.output
        assert isinstance(json.loads(result.stdout), dict)
