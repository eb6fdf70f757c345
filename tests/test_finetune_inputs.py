"""``finetune`` used as a careless or hostile user would (issue 69): one test per defect, then a fuzz suite.

Every run is a tiny random BERT on a small RTE-shaped train file (``test_finetune.write_train``), a few
steps. The fuzz draws settings and train files and checks the contract: no traceback, exit 0 only with a
finite model saved, one line and exit 2 otherwise, and no file of the user's changed.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import helpers
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_finetune import SMALL, write_train
from typer.testing import CliRunner

from bert_cluster.cli import app
from bert_cluster.errors import UserError
from bert_cluster.finetuning import FinetuneInterrupted, finetune

runner = CliRunner()
#: A short run with a checkpoint every 2 steps (the last two kept): 32 rows, 4 steps an epoch.
RUN = {"attention": SMALL, "max_steps": 6, "save_steps": 2, "batch_size": 8, "max_length": 32, "lora_rank": 4}
CLI_RUN = ["-t", "rte", "--clusters", "2", "--topk", "2", "--backend", "reference", "--max-steps", "2"]
CLI_RUN += ["--batch-size", "8", "--max-length", "32", "--lora-rank", "4", "-q"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return helpers.save_model(root / "model"), write_train(root / "data")


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
    """A run of 6 steps to its end (checkpoints 4 and 6 kept), copied by the tests that change it."""
    model, data = setup
    out = tmp_path_factory.mktemp("finished") / "out"
    finetune(model, "rte", out, data_dir=data, **RUN)
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to, symlinks=True)
    return to


def one_line(result, pattern: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0], lines[0]
    return lines[0]


def stop_at(step: int):
    """A Trainer callback raising KeyboardInterrupt (Ctrl-C) at the end of ``step``."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt

    return StopAt()


def poison_at(step: int, when: str = "on_step_end"):
    """A Trainer callback that sets a trained weight to NaN at ``step`` (a run diverging)."""
    from transformers import TrainerCallback

    class Poison(TrainerCallback):
        pass

    def poison(self, args, state, control, model=None, **kwargs):
        if state.global_step == step:
            weight = next(p for p in model.parameters() if p.requires_grad)
            with torch.no_grad():
                weight.view(-1)[0] = float("nan")

    setattr(Poison, when, poison)
    return Poison()


# --------------------------------------------------------------------------------------------------
# 1: non-finite settings, losses and weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("learning_rate", math.inf),
        ("learning_rate", math.nan),
        ("epochs", math.inf),
        ("distill_temperature", math.inf),
        ("distill", math.nan),
        ("distill", math.inf),
    ],
)
def test_non_finite_settings_are_refused_before_any_work(setup, tmp_path, setting, value):
    """``--lr inf`` trained every weight to NaN and reported "last loss 0.0000" with exit 0."""
    model, data = setup
    with pytest.raises(UserError, match=rf"^{setting} must be a (finite positive )?number"):
        finetune(model, "rte", tmp_path / "out", data_dir=data, **{setting: value})
    assert not (tmp_path / "out").exists()


def test_lr_inf_on_the_command_line_is_one_line_and_exit_2(setup, tmp_path):
    model, data = setup
    for value in ("inf", "nan", "-inf"):
        result = runner.invoke(
            app,
            [
                "finetune",
                str(model),
                *CLI_RUN,
                "-o",
                str(tmp_path / "out"),
                "--data-dir",
                str(data),
                "--lr",
                value,
            ],
        )
        one_line(result, "learning_rate must be")
    assert not (tmp_path / "out").exists()


def test_a_non_finite_loss_stops_the_run_keeping_the_last_good_checkpoint(setup, tmp_path):
    """A weight turned NaN after step 3: step 4's loss is NaN. Nothing is saved as the final model and
    no checkpoint of step 4; checkpoint-2 stays (it was whole)."""
    model, data = setup
    out = tmp_path / "out"
    with pytest.raises(
        UserError,
        match=r"training stopped at step 4: the loss is nan and the grad norm is nan; "
        r"nothing was saved as the final model and the last good checkpoint, checkpoint-2, is kept",
    ):
        finetune(model, "rte", out, data_dir=data, callbacks=[poison_at(3)], **RUN)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "checkpoint-2",
        "finetune-settings.json",
    ]
    assert not (out / "model.safetensors").exists() and not (out / "finetune.json").exists()
    from bert_cluster.finetuning import safety

    assert safety.damage(out / "checkpoints" / "checkpoint-2") is None


def test_a_checkpoint_with_non_finite_weights_is_never_saved(setup, tmp_path):
    """A weight turned NaN in the step whose checkpoint is due (an update overflowing with a finite loss)."""
    model, data = setup
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"training stopped at step 4: a trained weight is not finite"):
        finetune(model, "rte", out, data_dir=data, callbacks=[poison_at(4)], **RUN)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "checkpoint-2",
        "finetune-settings.json",
    ]


def test_a_model_is_checked_finite_before_it_is_written(setup, tmp_path):
    model, data = setup
    out = tmp_path / "out"
    with pytest.raises(
        UserError, match=r"the trained model has non-finite weights \(.*\): nothing was saved"
    ):
        finetune(model, "rte", out, data_dir=data, callbacks=[poison_at(6, "on_train_end")], **RUN)
    assert not (out / "model.safetensors").exists() and not (out / "finetune.json").exists()


def test_a_huge_learning_rate_on_the_command_line_stops_with_one_line(setup, tmp_path):
    model, data = setup
    arguments = ["finetune", str(model), *CLI_RUN, "-o", str(tmp_path / "out"), "--data-dir", str(data)]
    line = one_line(runner.invoke(app, [*arguments, "--lr", "1e30"]), "training stopped at step")
    assert "lower --learning-rate (it was 1e+30)" in line
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --------------------------------------------------------------------------------------------------
# 2: a resume checks the training data and the model's weights
# --------------------------------------------------------------------------------------------------


def test_a_resume_refuses_other_training_data_or_other_weights(setup, tmp_path):
    """The last checkpoint removed, --data-dir at a copy with other labels: exit 0, trained on other data."""
    model, data = setup
    out = tmp_path / "out"
    with pytest.raises(FinetuneInterrupted):
        finetune(model, "rte", out, data_dir=data, callbacks=[stop_at(3)], **RUN)
    before = files_of(out)
    other = copy(data, tmp_path / "other-data")
    train = other / "RTE" / "train.tsv"
    train.write_text(train.read_text().replace("\tentailment", "\tnot_entailment", 3), encoding="utf-8")
    with pytest.raises(UserError, match=r"cannot resume: the training data \(.*other-data.*\) changed since"):
        finetune(model, "rte", out, data_dir=other, resume=True, **RUN)
    changed = copy(model, tmp_path / "changed-model")
    weights = load_file(changed / "model.safetensors")
    weights["bert.encoder.layer.0.output.dense.bias"] += 0.01
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    # The same folder (the settings name the model by its path) with other weights in it.
    original = copy(model, tmp_path / "original")
    shutil.rmtree(model)
    shutil.copytree(changed, model)
    try:
        with pytest.raises(
            UserError, match=r"cannot resume: the model's weights \(.*\) changed since the run"
        ):
            finetune(model, "rte", out, data_dir=data, resume=True, **RUN)
    finally:
        shutil.rmtree(model)
        shutil.copytree(original, model)
    assert files_of(out) == before  # nothing touched by the refusals
    done = finetune(model, "rte", out, data_dir=data, resume=True, **RUN)
    assert done.steps == 6 and done.resumed_from == "checkpoint-2"
    assert len(done.settings["data_sha256"]) == len(done.settings["model_sha256"]) == 64


# --------------------------------------------------------------------------------------------------
# 4: an output that is, holds or lies in the model
# --------------------------------------------------------------------------------------------------


def test_an_output_that_is_holds_or_lies_in_the_model_is_refused(setup, tmp_path):
    """``finetune COPY -o COPY --overwrite`` replaced the source checkpoint's weights and config."""
    model, data = setup
    mine = copy(model, tmp_path / "models" / "mine")
    (tmp_path / "link").symlink_to(mine)
    before = files_of(tmp_path / "models")
    for output, where in [
        (mine, "is the model folder"),
        (tmp_path / "link", "is the model folder"),
        (mine / "tuned", "lies inside the model folder"),
        (tmp_path / "link" / "tuned", "lies inside the model folder"),
        (tmp_path / "models", "holds the model folder"),
    ]:
        for overwrite in ([], ["--overwrite"]):
            arguments = ["finetune", str(mine), *CLI_RUN, "-o", str(output), "--data-dir", str(data)]
            one_line(runner.invoke(app, [*arguments, *overwrite]), where)
    assert files_of(tmp_path / "models") == before


# --------------------------------------------------------------------------------------------------
# 5: --resume of a finished run; a checkpoint at the last step
# --------------------------------------------------------------------------------------------------


def test_resume_of_a_finished_run_says_so_and_changes_nothing(setup, finished, tmp_path):
    """It ran a step 31 past --max-steps 30, reported 31 steps and wrote checkpoint-31."""
    model, data = setup
    out = copy(finished, tmp_path / "out")
    before = {name: (content, (out / name).stat().st_mtime_ns) for name, content in files_of(out).items()}
    again = finetune(model, "rte", out, data_dir=data, resume=True, **RUN)
    assert again.already_finished and again.steps == 6
    assert again.loss_curve == json.loads((out / "finetune.json").read_text())["loss_curve"]
    assert {
        name: (content, (out / name).stat().st_mtime_ns) for name, content in files_of(out).items()
    } == before
    arguments = ["finetune", str(model), *CLI_RUN, "-o", str(out), "--data-dir", str(data), "--resume"]
    arguments[arguments.index("--max-steps") + 1] = "6"
    arguments += ["--save-steps", "2"]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 0, result.output
    assert f"{out} holds a finished run: nothing changed" in result.stderr
    assert result.stdout.startswith(f"finished already: {out} (6 steps, last loss ")
    with pytest.raises(UserError, match=r"other settings .*max_steps 6 -> 7"):
        finetune(model, "rte", out, data_dir=data, resume=True, **{**RUN, "max_steps": 7})


def test_a_run_killed_after_its_last_checkpoint_resumes_to_the_same_model_without_a_step_more(
    setup, finished, tmp_path
):
    model, data = setup
    out = copy(finished, tmp_path / "out")
    (out / "finetune.json").unlink()  # killed between the last checkpoint and the report
    (out / "model.safetensors").unlink()
    done = finetune(model, "rte", out, data_dir=data, resume=True, **RUN)
    assert done.steps == 6 and done.resumed_from == "checkpoint-6" and len(done.loss_curve) == 6
    assert sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*")) == [
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert files_of(out)["model.safetensors"] == files_of(finished)["model.safetensors"]


# --------------------------------------------------------------------------------------------------
# 6, 10: damaged checkpoints fall back to the newest intact one, naming the one skipped
# --------------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _flip_to_nan(path: Path) -> None:
    """Every float of the file's first tensor set to NaN, in place (the bytes, not the header)."""
    weights = load_file(path)
    name = sorted(weights)[0]
    old = weights[name].contiguous().numpy().tobytes()
    data = path.read_bytes()
    at = data.index(old)
    nan = torch.full_like(weights[name], float("nan")).numpy().tobytes()
    path.write_bytes(data[:at] + nan + data[at + len(old) :])


@pytest.mark.parametrize(
    ("damage", "checksums", "why"),
    [
        (_truncate, True, "adapter_model.safetensors does not match its checksum"),
        (_truncate, False, "adapter_model.safetensors cannot be read"),
        (_flip_to_nan, True, "adapter_model.safetensors does not match its checksum"),
        (_flip_to_nan, False, "adapter_model.safetensors holds a non-finite value"),
        (lambda path: path.with_name("trainer_state.json").write_text("{garbage"), True,
         "trainer_state.json cannot be read"),
        (lambda path: path.with_name("optimizer.pt").write_bytes(b"PK\x03\x04 cut"), False,
         "optimizer.pt cannot be read"),
    ],
)  # fmt: skip
def test_a_damaged_checkpoint_falls_back_to_the_one_before_naming_it(
    setup, finished, tmp_path, damage, checksums, why
):
    """A truncated adapter_model.safetensors was a SafetensorError traceback, a damaged
    trainer_state.json a JSONDecodeError naming no file; flipped bytes were trained on (NaN everywhere)."""
    model, data = setup
    out = copy(finished, tmp_path / "out")
    (out / "finetune.json").unlink()
    last = out / "checkpoints" / "checkpoint-6"
    if not checksums:  # as an older version, or a kill just before they were written, left it
        (last / "finetune-checksums.json").unlink(missing_ok=True)
    damage(last / "adapter_model.safetensors")
    arguments = ["finetune", str(model), *CLI_RUN, "-o", str(out), "--data-dir", str(data), "--resume"]
    arguments[arguments.index("--max-steps") + 1] = "6"
    result = runner.invoke(app, [*arguments, "--save-steps", "2"])
    assert result.exit_code == 0, result.output
    assert result.stderr.strip().splitlines() == [
        f"skipped checkpoint-6: it is damaged ({why}" + result.stderr.strip().split(why, 1)[1]
    ]
    document = json.loads((out / "finetune.json").read_text())
    assert document["resumed_from"] == "checkpoint-4" and list(document["skipped_checkpoints"]) == [
        "checkpoint-6"
    ]
    assert files_of(out)["model.safetensors"] == files_of(finished)["model.safetensors"]  # bit for bit


def test_every_checkpoint_damaged_is_one_line_naming_them(setup, finished, tmp_path):
    model, data = setup
    out = copy(finished, tmp_path / "out")
    (out / "finetune.json").unlink()
    for name in ("checkpoint-4", "checkpoint-6"):
        (out / "checkpoints" / name / "trainer_state.json").write_text("")
    with pytest.raises(
        UserError,
        match=r"nothing to resume in .*: every checkpoint is damaged \(checkpoint-6: "
        r"trainer_state.json cannot be read \(JSONDecodeError\); checkpoint-4: .*--overwrite",
    ):
        finetune(model, "rte", out, data_dir=data, resume=True, **RUN)


# --------------------------------------------------------------------------------------------------
# 7, 11: every bad row named by file and line before any training
# --------------------------------------------------------------------------------------------------


def test_a_train_row_with_a_missing_column_is_named_by_its_line(setup, tmp_path):
    """It was "label '' is not one of [...]", no line; blank lines before it count as an editor counts."""
    model, data = setup
    bad = copy(data, tmp_path / "data")
    train = bad / "RTE" / "train.tsv"
    lines = train.read_text().splitlines()
    lines[4] = lines[4].rsplit("\t", 1)[0]  # line 5 without its label
    train.write_text("\n".join(lines[:2] + ["", ""] + lines[2:]) + "\n", encoding="utf-8")  # now line 7
    result = runner.invoke(
        app, ["finetune", str(model), *CLI_RUN, "-o", str(tmp_path / "out"), "--data-dir", str(bad)]
    )
    one_line(result, f"{train} line 7: task rte: label '' is not one of ['entailment', 'not_entailment']")
    assert not (tmp_path / "out").exists()


def test_a_null_text_in_a_parquet_train_file_is_named_not_trained_as_none(setup, tmp_path):
    import datasets

    model, _ = setup
    rows = {"sentence1": ["a b", "c d", "e f"], "sentence2": ["x", None, "z"], "label": [0, 1, 0]}
    (tmp_path / "data" / "rte").mkdir(parents=True)
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "data" / "rte" / "train.parquet"))
    with pytest.raises(UserError, match=r"rte/train.parquet row 2: no sentence2 \(missing or null\)"):
        finetune(model, "rte", tmp_path / "out", data_dir=tmp_path / "data", **RUN)


@pytest.mark.parametrize(
    ("task", "row", "message"),
    [
        ("rte", {"sentence1": "a \ud800", "sentence2": "b", "label": 0},
         "sentence1 is not valid Unicode: a lone surrogate U+D800 at character 3, which no tokenizer takes"),
        ("rte", {"sentence1": "a", "sentence2": ["b"], "label": 0}, "sentence2 is a list, not text"),
        ("rte", {"sentence1": "a", "sentence2": "b", "label": 7},
         "task rte: label 7 is not an index into ['entailment', 'not_entailment']"),
        ("stsb", {"sentence1": "a", "sentence2": "b", "label": "high"},
         "task stsb: regression label 'high' is not a number"),
        ("squad", {"question": "q", "context": "c", "answers": {"text": ["c"], "answer_start": [-1]}},
         "every answer_start must be a non-negative int, got [-1]"),
        ("squad", {"question": "q", "context": "c", "answers": {"text": ["c"]}},
         "answers must hold lists 'text' and 'answer_start' of one length"),
    ],
)  # fmt: skip
def test_every_row_is_checked_before_training_naming_where_it_is(task, row, message):
    """No train file format read today carries a lone surrogate (pyarrow replaces one), but a row given
    otherwise could: the tokenizer then failed with a TypeError naming no row."""
    from bert_cluster.tasks.config import get_tasks
    from bert_cluster.tasks.kinds import check_rows

    (config,) = get_tasks(task)
    good = {"sentence1": "a", "sentence2": "b", "label": 0}
    if task == "squad":
        good = {"question": "q", "context": "c", "answers": {"text": [], "answer_start": []}}
    check_rows([good, good], config, lambda index, _: f"data line {index + 2}")
    with pytest.raises(UserError) as raised:
        check_rows([good, row], config, lambda index, _: f"data line {index + 2}")
    assert str(raised.value) == f"data line 3: {message}"


# --------------------------------------------------------------------------------------------------
# Fuzz: settings, train files and output folders as a careless or hostile user gives them
# --------------------------------------------------------------------------------------------------

FUZZ = settings(  # derandomized: the same examples in every run, so that CI and a laptop agree
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Each option's values: sound ones, and the ones that trip a check (or were not checked).
VALUES = {
    "--lr": ["1e-3", "0", "-1", "inf", "-inf", "nan", "1e30", "1e-300", "abc"],
    "--epochs": ["0.1", "0", "inf", "nan"],
    "--batch-size": ["8", "0", "-2", "1.5"],
    "--max-length": ["16", "3", "0", "600"],
    "--limit": ["1", "3", "0"],
    "--save-steps": ["1", "0"],
    "--seed": ["0", "7", "-1"],
    "--distill": ["0.5", "1", "2", "-0.1", "nan"],
    "--distill-temperature": ["2", "0", "inf"],
    "--lora-rank": ["2", "0"],
    "--clusters": ["2", "0", "2,3"],
    "--topk": ["2", "0"],
    "--device": ["cpu", "cuda:7", "tpu"],
}
FLAGS = ["--lora", "--full", "--exact", "--resume", "--overwrite"]
#: What the train file is made of: the good one (thrice as likely), or it with one hostile change.
DATA = ["good"] * 3 + [
    "missing label",
    "unknown label",
    "blank lines",
    "extra cell",
    "not UTF-8",
    "empty",
    "none",
]
#: Where the output goes (a fresh folder thrice as likely).
OUTPUTS = ["fresh"] * 3 + ["model", "inside model", "holds model", "user folder", "a file", "finished run"]


def _train_file(kind: str, data: Path, folder: Path) -> Path | None:
    """The data folder for ``kind``: a copy of ``data`` with one change (None: no data folder at all)."""
    if kind == "none":
        return folder / "no-such-folder"
    copied = copy(data, folder / "data")
    train = copied / "RTE" / "train.tsv"
    lines = train.read_text(encoding="utf-8").splitlines()
    if kind == "missing label":
        lines[3] = lines[3].rsplit("\t", 1)[0]
    elif kind == "unknown label":
        lines[2] = lines[2].rsplit("\t", 1)[0] + "\tmaybe"
    elif kind == "blank lines":
        lines[2:2] = ["", ""]
    elif kind == "extra cell":
        lines[4] += "\tmore"
    elif kind == "empty":
        lines = lines[:1]
    text = "\n".join(lines) + "\n"
    train.write_bytes(
        text.encode() if kind != "not UTF-8" else text.encode()[:60] + b"\xff\xfe" + text.encode()[60:]
    )
    return copied


@pytest.mark.slow(reason="40 drawn finetune commands, each a run of up to two steps")
@FUZZ
# CI drew this one once: --overwrite into a folder of the user's
@example(options={}, flags=["--lora", "--overwrite"], data_kind="good", output_kind="user folder")
@given(
    options=st.dictionaries(st.sampled_from(sorted(VALUES)), st.none(), max_size=4).flatmap(
        lambda chosen: st.fixed_dictionaries({name: st.sampled_from(VALUES[name]) for name in chosen})
    ),
    flags=st.lists(st.sampled_from(FLAGS), max_size=2, unique=True),
    data_kind=st.sampled_from(DATA),
    output_kind=st.sampled_from(OUTPUTS),
)
def test_fuzz_finetune(setup, finished, tmp_path_factory, options, flags, data_kind, output_kind):
    """No traceback; exit 2 with one line, or exit 0 with a finite model saved; no user file changed."""
    model, data = setup
    root = tmp_path_factory.mktemp("fuzz")
    mine = copy(model, root / "models" / "mine")
    folder = _train_file(data_kind, data, root)
    user = root / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (root / "a-file").write_text("mine too")
    out = {
        "fresh": root / "out",
        "model": mine,
        "inside model": mine / "tuned",
        "holds model": root / "models",
        "user folder": user,
        "a file": root / "a-file",
        "finished run": copy(finished, root / "finished") if output_kind == "finished run" else None,
    }[output_kind]
    before = {name: files_of(root / name) for name in ("models", "user")}
    before["data"] = files_of(folder) if folder.is_dir() else {}
    # Short runs only: a step or two, unless a drawn option asks otherwise.
    arguments = ["finetune", str(mine), "-t", "rte", "-o", str(out), "--data-dir", str(folder), "-q"]
    settings_ = {"--max-steps": "2", "--batch-size": "8", "--max-length": "32"}
    if "--exact" not in flags:  # the control takes no attention settings (drawn ones are still given)
        settings_.update({"--clusters": "2", "--topk": "2", "--backend": "reference"})
    settings_.update(options)
    if "--epochs" in options:
        del settings_["--max-steps"]
    for name, value in settings_.items():
        arguments += [name, value]
    arguments += flags
    result = runner.invoke(app, arguments)

    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 2), result.output
    event(f"exit {result.exit_code}")  # pytest --hypothesis-show-statistics: how many ran, how many refused
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        event(" ".join(lines[0].replace(str(root), "ROOT").split()[:6]))
    else:
        weights = load_file(out / "model.safetensors")
        assert all(bool(torch.isfinite(tensor).all()) for tensor in weights.values())
        assert json.loads((out / "finetune.json").read_text())["steps"] >= 1
    assert files_of(root / "models") == before["models"]  # the model, whatever was asked
    after_user = files_of(root / "user")
    if out == user and result.exit_code == 0:  # --overwrite into it: the run's files added, the user's kept
        assert {name: after_user[name] for name in before["user"] if name in after_user} == before["user"]
    else:
        assert after_user == before["user"]
    assert (root / "a-file").read_text() == "mine too"
    assert (files_of(folder) if folder.is_dir() else {}) == before["data"]
    shutil.rmtree(root)
