"""The CLI through typer's runner: the API is patched where only the shell is under test."""

from __future__ import annotations

import json
from pathlib import Path

import helpers
import pytest
from typer.testing import CliRunner

from bert_cluster import __version__
from bert_cluster.cli import ATTENTION_OPTIONS, app
from bert_cluster.config import BACKENDS, MODES, ClusteredAttentionConfig
from bert_cluster.evaluation.report import Results, RunResult, TaskResult

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
        RunResult(None, None, {"accuracy": 60.0}, 1.0, 277.0, 9000.0, 1.0, "sdpa"),
        RunResult(25, 0, {"accuracy": 59.0}, 2.0, 138.5, 4500.0, 0.5, "cpu", "i-clustered"),
        RunResult(25, 1, {"accuracy": 61.0}, 0.5, 554.0, 18000.0, 2.0, "cpu", "i-clustered"),
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
        settings={"modes": ["i-clustered"], "seeds": [0, 1], "clusters": [25]},
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


def test_evaluate_passes_options_to_the_api_and_renders_scores_beside_speed(patched, tmp_path):
    result = runner.invoke(
        app,
        [
            "evaluate",
            "some/model",
            *("--task", "rte", "--clusters", "10,25", "--seeds", "2", "--limit", "64"),
            *("--data-dir", str(tmp_path), "--data-dir", "b"),
            *("--mode", "clustered", "--mode", "i-clustered", "--batch-size", "8", "--max-length", "128"),
            *("--topk", "16", "--bits", "31", "--iterations", "3", "--min-length", "64"),
            *("--layers", "0,2", "--backend", "reference", "--output", str(tmp_path / "o"), "--overwrite"),
        ],
    )
    assert result.exit_code == 0, result.output
    model, kwargs = patched[0]
    assert model == "some/model"
    assert kwargs["tasks"] == "rte" and kwargs["clusters"] == "10,25" and kwargs["seeds"] == 2
    assert kwargs["data_dir"] == [tmp_path, Path("b")] and kwargs["limit"] == 64
    assert (
        kwargs["mode"] == ["clustered", "i-clustered"]
        and kwargs["batch_size"] == 8
        and kwargs["max_length"] == 128
    )
    assert kwargs["attention"] == {
        "topk": 16,
        "bits": 31,
        "iterations": 3,
        "min_length": 64,
        "layers": (0, 2),
        "backend": "reference",
    }
    assert kwargs["output"] == tmp_path / "o" and kwargs["overwrite"] is True
    assert "60.00" in result.stdout and "60.00 ± 1.41 (+0.00)" in result.stdout
    assert "1.25× (1.2 s)" in result.stdout  # speed beside the scores: mean speedup, mean wall time
    assert "read /d/RTE/dev.tsv" in result.stdout


def test_attention_options_are_given_only_when_set(patched):
    result = runner.invoke(app, ["evaluate", "m", "-t", "rte", "-q"])
    assert result.exit_code == 0, result.output
    assert patched[0][1]["attention"] == {} and patched[0][1]["reporter"] is None
    assert "read /d/RTE" not in result.stdout and result.stderr == ""


def test_every_shared_attention_setting_is_a_field_of_the_config():
    import dataclasses

    from bert_cluster.config import ClusteredAttentionConfig

    fields = {field.name for field in dataclasses.fields(ClusteredAttentionConfig)}
    assert set(ATTENTION_OPTIONS) <= fields
    assert fields - set(ATTENTION_OPTIONS) <= {"clusters", "mode", "seed"}  # the ones evaluate sweeps


def test_help_lists_the_choices_and_version():
    text = runner.invoke(app, ["evaluate", "--help"], env={"COLUMNS": "240"}).stdout
    assert "|".join(MODES) in text and "|".join(BACKENDS) in text
    for option in ("--topk", "--bits", "--iterations", "--min-length", "--layers", "--backend", "--quiet"):
        assert option in text
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.stdout.strip() == f"bert-cluster {__version__}"


def test_an_unknown_choice_exits_2():
    result = runner.invoke(app, ["evaluate", "m", "--backend", "tpu"])
    assert result.exit_code == 2 and "tpu" in result.output


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


def test_ctrl_c_says_where_the_partial_results_are(monkeypatch, tmp_path):
    from bert_cluster.evaluation import RunInterrupted

    results = fake_results()
    results.tasks[0].status = "interrupted"

    def interrupted(model, **kwargs):
        error = RunInterrupted(results)
        error.written = tmp_path / "results.json"
        raise error

    monkeypatch.setattr("bert_cluster.evaluation.run", interrupted)
    result = runner.invoke(app, ["evaluate", "m", "-t", "rte", "-o", str(tmp_path)])
    assert result.exit_code == 130
    assert (
        result.stderr.strip()
        == f"interrupted: partial results in {tmp_path}/results.json; task rte marked interrupted"
    )


def one_line_error(result, pattern: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return helpers.save_model(tmp_path_factory.mktemp("cli") / "cls")


def test_user_errors_are_one_line_and_exit_2(tmp_path, tiny_folder, monkeypatch):
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
    one_line_error(
        runner.invoke(app, ["evaluate", str(tiny_folder), "-t", "rte", "--max-length", "4096"]),
        "--max-length 4096 is more than model",
    )
    one_line_error(
        runner.invoke(app, ["evaluate", str(tiny_folder), "-t", "rte", "--bits", "99"]), "bits must be"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = runner.invoke(
        app, ["evaluate", str(tiny_folder), "-q", "--task", "rte", "--data-dir", str(empty)]
    )
    one_line_error(missing, f"looked at: {empty}/RTE/dev.tsv")
    monkeypatch.setenv("BERT_CLUSTER_BACKEND", "fast")
    one_line_error(
        runner.invoke(app, ["evaluate", str(tiny_folder), "-t", "rte"]), "BERT_CLUSTER_BACKEND='fast'"
    )


def test_a_bad_output_is_refused_before_any_work(tmp_path, tiny_folder, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_load)
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", no_load)
    afile = tmp_path / "file"
    afile.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "results.json").write_text("{}")
    for arguments, message in (
        (["evaluate", str(tiny_folder), "-t", "rte", "-o", str(afile)], "is a file"),
        (["evaluate", str(tiny_folder), "-t", "rte", "-o", str(afile / "sub")], "is a file"),
        (["evaluate", str(tiny_folder), "-t", "rte", "-o", str(full)], "is not empty (results.json)"),
        (["convert", str(tiny_folder), str(afile)], "is a file"),
        (["convert", str(tiny_folder), str(afile / "sub")], "is a file"),
        (["convert", str(tiny_folder), str(full)], "is not empty"),
    ):
        one_line_error(runner.invoke(app, arguments), message)
    assert (full / "results.json").read_text() == "{}"


def test_convert_into_its_own_model_folder_is_refused_overwrite_or_not(tmp_path):
    """Issue 69: an output that is the model (or holds it, or lies in it) would replace the model's own
    files; ``--overwrite`` only means "replace an earlier output"."""
    model = helpers.save_model(tmp_path / "model")
    (tmp_path / "link").symlink_to(model)
    before = {path.name: path.read_bytes() for path in model.iterdir()}
    for output, where in (
        (model, "is the model folder"),
        (tmp_path / "link", "is the model folder"),
        (model / "converted", "lies inside the model folder"),
        (tmp_path, "holds the model folder"),
    ):
        for overwrite in ([], ["--overwrite"]):
            one_line_error(runner.invoke(app, ["convert", str(model), str(output), *overwrite]), where)
    assert {path.name: path.read_bytes() for path in model.iterdir()} == before


def test_progress_goes_to_stderr_as_plain_lines_and_results_to_stdout(tmp_path, tiny_folder):
    helpers.write_rte(tmp_path / "data", helpers.RTE_ROWS)
    result = runner.invoke(
        app, ["evaluate", str(tiny_folder), "-t", "rte", "-c", "2", "--data-dir", str(tmp_path / "data")]
    )
    assert result.exit_code == 0, result.output
    mode = ClusteredAttentionConfig().mode
    assert "[rte] unmodified: accuracy" in result.stderr and f"[rte] {mode} C=2 seed=0" in result.stderr
    assert "[rte]" not in result.stdout and "speed" in result.stdout and "accuracy" not in result.stdout


def test_head_and_label_mismatches_exit_2(tmp_path):
    helpers.write_rte(tmp_path / "data", helpers.RTE_ROWS)
    qa = helpers.save_model(tmp_path / "qa", head="qa", labels=None)
    one_line_error(
        runner.invoke(app, ["evaluate", str(qa), "-q", "-t", "rte", "--data-dir", str(tmp_path / "data")]),
        "no trained sequence-classification head",
    )
    wrong = helpers.save_model(tmp_path / "wrong", labels=("negative", "positive"))
    one_line_error(
        runner.invoke(app, ["evaluate", str(wrong), "-q", "-t", "rte", "--data-dir", str(tmp_path / "data")]),
        "do not match",
    )


def test_convert_saves_a_patched_checkpoint(tmp_path, tiny_folder):
    result = runner.invoke(
        app,
        ["convert", str(tiny_folder), str(tmp_path / "out"), "--clusters", "3", "--topk", "4", "--seed", "7"],
    )
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["clustered_attention"]["clusters"] == 3 and config["clustered_attention"]["seed"] == 7
    assert config["clustered_attention"]["topk"] == 4
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    again = runner.invoke(
        app, ["convert", str(tiny_folder), str(tmp_path / "out"), "--overwrite", "--bits", "8"]
    )
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["clustered_attention"]["bits"] == 8
    one_line_error(
        runner.invoke(app, ["convert", str(tiny_folder), str(tmp_path / "o2"), "--clusters", "0"]),
        "clusters must be",
    )
    bad_layers = runner.invoke(app, ["convert", str(tiny_folder), str(tmp_path / "o3"), "--layers", "0,a"])
    assert bad_layers.exit_code == 2 and "malformed layer list" in bad_layers.output


def test_an_unwritable_convert_output_is_one_line_and_exit_2(tmp_path, tiny_folder, monkeypatch):
    import transformers

    def denied(self, folder, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(Path(folder) / "config.json"))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", denied)
    result = runner.invoke(app, ["convert", str(tiny_folder), str(tmp_path / "out")])
    one_line_error(result, f"cannot write the checkpoint to {tmp_path / 'out'}: Permission denied")


def test_ls_and_validate():
    listed = runner.invoke(app, ["ls", "--json"])
    assert listed.exit_code == 0
    names = {task["name"] for task in json.loads(listed.stdout)}
    expected = {
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
    }
    assert expected | {"squad_v2", "stsb-embedding", "squad-retrieval"} <= names
    valid = runner.invoke(app, ["validate"])
    assert valid.exit_code == 0 and "valid" in valid.stdout


def test_validate_reports_bad_kinds_and_metric_names(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkind: nosuchkind\nversion: 1\n")
    one_line_error(
        runner.invoke(app, ["validate", str(bad)]), "has kind 'nosuchkind', which is not registered"
    )
    metric = tmp_path / "metric.yaml"
    metric.write_text(
        "name: x\nkind: classification\nversion: 1\ntext_fields: [a]\nlabel_field: l\nmetrics: [acuracy]\n"
    )
    one_line_error(runner.invoke(app, ["validate", str(metric)]), "unknown metric(s) ['acuracy']")


def test_a_broken_file_is_named_and_blocks_nothing(tmp_path, monkeypatch):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "good.yaml").write_text(
        "name: good\nkind: classification\nversion: 1\ntext_fields: [a]\nlabel_field: l\n"
        "metrics: [accuracy]\n"
    )
    (tmp_path / "tasks" / "broken.yaml").write_text("name: [\n")
    monkeypatch.setenv("BERT_CLUSTER_CONFIGS", str(tmp_path))
    listed = runner.invoke(app, ["ls", "--json"])
    assert listed.exit_code == 0 and [t["name"] for t in json.loads(listed.stdout)] == ["good"]
    assert "broken.yaml" in listed.stderr
    one_line_error(runner.invoke(app, ["validate"]), "broken.yaml")
    monkeypatch.setenv("BERT_CLUSTER_CONFIGS", str(tmp_path / "nowhere"))
    one_line_error(runner.invoke(app, ["ls"]), "does not exist")


def test_info_prints_build_information():
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    assert isinstance(json.loads(result.stdout), dict)


def test_log_reporter_and_candidate_lines_print_one_plain_line_per_step():
    import io

    from rich.console import Console

    from bert_cluster import render

    out = io.StringIO()
    console = Console(file=out, width=300)
    assert isinstance(render.progress_reporter(console), render.LogReporter)  # not a terminal
    assert isinstance(
        render.progress_reporter(Console(file=io.StringIO(), force_terminal=True)), render.RichReporter
    )
    reporter = render.CandidateLines(render.LogReporter(console, every=0.0), console)
    results = fake_results()
    reporter.start(1)
    reporter.task("rte", 3)
    reporter.configuration("unmodified")
    reporter.advance(1, 4)
    reporter.configuration_done(results.tasks[0].runs[1])
    reporter.task_done(results.tasks[0])

    class Scored:
        label, changes, speedup, screen, status = (
            "i-clustered C=2 k=4 layers=all",
            {"acc": -0.25},
            1.5,
            None,
            "ok",
        )

    reporter.candidate(Scored())
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["1 task(s)", "[rte] 3 configuration(s)", "[rte] unmodified: 1/4 (25%), ETA 0 s"]
    assert lines[3:] == [
        "[rte] i-clustered C=25 seed=0: accuracy 59.00 (2.0 s, 0.50x, cpu)",
        "[rte] ok (data: /d/RTE/dev.tsv)",
        "i-clustered C=2 k=4 layers=all: Δ acc -0.25, 1.50×: ok",
    ]


def test_the_terminal_tables_have_the_markdown_rows():
    import io

    from rich.console import Console

    from bert_cluster import render
    from bert_cluster.evaluation import report

    results = fake_results()
    header, rows = report.table_rows(results)
    table = render.results_table(results)
    assert [column.header for column in table.columns] == header and table.row_count == len(rows)
    assert [column.justify for column in table.columns][:3] == ["left", "left", "right"]
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    assert all(cell in out.getvalue() for row in rows for cell in row)


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "m", "out", "--mode", "xyz"],
        ["inspect", "m", "--mode", "xyz"],
        ["evaluate", "m", "--backend", "tpu"],
        ["convert", "m", "out", "--no-such-option"],
        ["convert"],
        ["kernels", "build", "--bogus"],
        ["no-such-command"],
    ],
    ids=lambda args: " ".join(args),
)
def test_a_usage_error_is_one_line_and_exit_2(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Usage" not in result.output, result.output
    assert result.stderr.startswith("error: ") and "--help`)" in result.stderr
