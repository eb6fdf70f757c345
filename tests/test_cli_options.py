"""Each shared CLI option is declared once and each default is read from the presets in config.py.

The API is patched where only the shell is under test: it records what the command built, then stops.
"""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
from typer.testing import CliRunner

from bert_cluster import config as config_module
from bert_cluster.cli import app
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError

runner = CliRunner()

#: Presets changed in every setting the commands take one of, so that a default written into the CLI
#: (instead of read from the preset) shows.
CHANGED = {"clusters": 7, "mode": "clustered", "seed": 3, "topk": 5}


class Stop(Exception):
    """Raised by a patched API function once it has recorded its arguments."""


@pytest.fixture
def presets(monkeypatch):
    monkeypatch.setattr(config_module, "CONVERT_SETTINGS", {**config_module.CONVERT_SETTINGS, **CHANGED})
    monkeypatch.setattr(
        config_module, "EVALUATION_SETTINGS", {**config_module.EVALUATION_SETTINGS, **CHANGED}
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return helpers.save_model(tmp_path_factory.mktemp("options") / "cls")


def recorder(monkeypatch, target: str) -> list:
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        raise Stop

    monkeypatch.setattr(target, record)
    return calls


def test_convert_and_embed_default_to_the_convert_preset(presets, monkeypatch, tmp_path):
    calls = recorder(monkeypatch, "bert_cluster.checkpoints.convert_checkpoint")
    result = runner.invoke(app, ["convert", "some/model", str(tmp_path / "out")])
    assert isinstance(result.exception, Stop), result.output
    assert calls[0][0][2] == ClusteredAttentionConfig.for_convert()
    assert calls[0][0][2].clusters == 7 and calls[0][0][2].mode == "clustered"
    calls = recorder(monkeypatch, "bert_cluster.embedding.embed")
    result = runner.invoke(app, ["embed", "some/model", "input.txt", "-o", str(tmp_path / "emb")])
    assert isinstance(result.exception, Stop), result.output
    assert calls[0][1]["attention"] == ClusteredAttentionConfig.for_convert()


def test_inspect_and_evaluate_default_to_the_evaluation_preset(presets, monkeypatch, tiny_folder):
    calls = recorder(monkeypatch, "bert_cluster.inspection.inspect_checkpoint")
    result = runner.invoke(app, ["inspect", "some/model", "--text", "a text"])
    assert isinstance(result.exception, Stop), result.output
    assert calls[0][0][2] == ClusteredAttentionConfig.for_evaluation()
    calls = recorder(monkeypatch, "bert_cluster.evaluation.runner.run_plan")
    result = runner.invoke(app, ["evaluate", str(tiny_folder), "--task", "rte"])
    assert isinstance(result.exception, Stop), result.output
    plan = calls[0][0][0]
    assert plan.clusters == (7,) and plan.attention == ClusteredAttentionConfig.for_evaluation()
    assert plan.configurations()[0] == ClusteredAttentionConfig.for_evaluation()


@pytest.mark.parametrize(
    "command",
    [
        ["evaluate", "MODEL", "--task", "rte"],
        ["tune", "MODEL", "--task", "rte"],
        ["convert", "MODEL", "OUT"],
        ["embed", "MODEL", "input.txt", "-o", "OUT"],
        ["inspect", "MODEL", "--text", "a text"],
        ["serve", "MODEL"],
    ],
    ids=lambda command: command[0],
)
def test_a_malformed_cluster_count_is_one_line_and_exit_2_on_every_command(command, tiny_folder, tmp_path):
    args = [
        str(tiny_folder) if arg == "MODEL" else str(tmp_path / "out") if arg == "OUT" else arg
        for arg in command
    ]
    result = runner.invoke(app, [*args, "--clusters", "abc"])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Usage" not in result.output
    assert result.stderr.startswith("error: malformed cluster list 'abc': ")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--clusters", "10,25"], "--clusters: this command takes one cluster count C, got 10,25"),
        (["--mode", "clustered", "--mode", "i-clustered"], "--mode: this command takes one mode"),
    ],
)
def test_a_command_of_one_configuration_refuses_several(extra, message, tmp_path):
    result = runner.invoke(app, ["convert", "some/model", str(tmp_path / "out"), *extra])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_setting_of_attention_is_never_silently_replaced(monkeypatch, tiny_folder):
    from bert_cluster import evaluation

    calls = recorder(monkeypatch, "bert_cluster.evaluation.runner.run_plan")
    for attention, arguments, named in [
        ({"clusters": 10}, {"clusters": 25}, "clusters"),
        ({"mode": "clustered"}, {"mode": "i-clustered"}, "mode"),
        ({"seed": 4}, {"seeds": 2}, "seed"),
        (ClusteredAttentionConfig(clusters=10), {"clusters": "10,25"}, "clusters"),
    ]:
        with pytest.raises(ValueError, match=f"attention= sets {named}=.* give {named} in one place"):
            evaluation.evaluate(tiny_folder, "rte", attention=attention, **arguments)
    assert calls == []
    with pytest.raises(Stop):  # set once, in attention=: taken, not replaced by the preset's
        evaluation.evaluate(tiny_folder, "rte", attention={"clusters": 10, "seed": 4})
    plan = calls[0][0][0]
    assert plan.clusters == (10,) and plan.seeds == (4,)
    with pytest.raises(Stop):  # the same value in both places is no conflict
        evaluation.evaluate(tiny_folder, "rte", clusters=10, attention={"clusters": 10})


def test_tune_refuses_attention_settings_it_searches(tiny_folder):
    from bert_cluster import evaluation

    with pytest.raises(UserError, match="attention= sets topk, which tune searches"):
        evaluation.tune(tiny_folder, "rte", 0.5, attention={"topk": 8})


# What the options of one name take, now that each is one declaration: --topk several and --layers
# search only in tune, --data-dir repeated in inspect as in evaluate.


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--topk", "16,32"], "--topk: this command takes one k, got 16,32 (tune takes several)"),
        (["--topk", "abc"], "--topk takes an int, got 'abc'"),
        (["--layers", "search"], "--layers search: only tune searches layers"),
        (["--layers", "0,a"], "--layers: malformed layer list '0,a'"),
    ],
)
def test_what_only_tune_takes_is_one_line_and_exit_2_elsewhere(extra, message, monkeypatch, tmp_path):
    calls = recorder(monkeypatch, "bert_cluster.checkpoints.convert_checkpoint")
    result = runner.invoke(app, ["convert", "some/model", str(tmp_path / "out"), *extra])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert calls == []


def test_one_k_and_layers_all_reach_the_config(monkeypatch, tmp_path):
    calls = recorder(monkeypatch, "bert_cluster.checkpoints.convert_checkpoint")
    result = runner.invoke(
        app, ["convert", "some/model", str(tmp_path / "out"), "--topk", "16", "--layers", "all"]
    )
    assert isinstance(result.exception, Stop), result.output
    config = calls[0][0][2]
    assert config.topk == 16 and config.layers is None


def test_tune_takes_several_k_and_searches_layers_by_default(monkeypatch):
    calls = recorder(monkeypatch, "bert_cluster.evaluation.tune")
    result = runner.invoke(app, ["tune", "some/model", "-t", "rte", "--topk", "8,16"])
    assert isinstance(result.exception, Stop), result.output
    assert calls[0][1]["topk"] == "8,16" and calls[0][1]["layers"] == "search"
    result = runner.invoke(app, ["tune", "some/model", "-t", "rte", "--layers", "1,0"])
    assert isinstance(result.exception, Stop), result.output
    assert calls[1][1]["layers"] == (1, 0)


def test_inspect_takes_data_dir_repeated_as_evaluate_does(monkeypatch, tmp_path):
    """One folder is recorded in inspect.json's settings as before (a string), several as a list."""
    seen = []
    monkeypatch.setattr(
        "bert_cluster.evaluation.load_task_texts", lambda task, folders, limit: seen.append(folders) or ["a"]
    )
    calls = recorder(monkeypatch, "bert_cluster.inspection.inspect_checkpoint")
    for folders, recorded in (([tmp_path], str(tmp_path)), ([tmp_path, Path("b")], [str(tmp_path), "b"])):
        given = [part for folder in folders for part in ("--data-dir", str(folder))]
        result = runner.invoke(app, ["inspect", "some/model", "--task", "rte", *given])
        assert isinstance(result.exception, Stop), result.output
        assert seen[-1] == folders and calls[-1][1]["settings"]["data_dir"] == recorded
