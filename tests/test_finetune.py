"""``bert-cluster finetune`` on a tiny random BERT and a small RTE-shaped train file written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import helpers
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from bert_cluster.cli import app
from bert_cluster.finetuning import finetune
from bert_cluster.hf import ATTENTION_NAME

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
#: Small enough for a few seconds a run on 2 shared cores; every row is clustered (C=2, k=2 of ~30 tokens).
SMALL = {"clusters": 2, "topk": 2, "backend": "reference"}


def write_train(folder: Path) -> Path:
    """``RTE/train.tsv``: the label is whether the second sentence says yes (learnable by a tiny model)."""
    rows = []
    for index in range(32):
        first = f"case {index} of the {('red', 'blue', 'green', 'old')[index % 4]} test"
        yes = index % 2 == 0
        rows.append((first, "yes it is" if yes else "no way", "entailment" if yes else "not_entailment"))
    path = folder / "RTE" / "train.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["index\tsentence1\tsentence2\tlabel"]
    lines += [f"{index}\t{a}\t{b}\t{label}" for index, (a, b, label) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    return helpers.save_model(root / "model"), write_train(root / "data")


def train_loss(folder: Path, data: Path) -> float:
    """The mean loss of the checkpoint in ``folder`` (loaded as saved: patched or not) over the train rows."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lines = (data / "RTE" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    rows = [line.split("\t") for line in lines]
    batch = tokenizer([r[1] for r in rows], [r[2] for r in rows], padding=True, return_tensors="pt")
    labels = torch.tensor([0 if r[3] == "entailment" else 1 for r in rows])
    with torch.no_grad():
        return float(model(**batch, labels=labels).loss)


class Recorder:
    """A Trainer callback that notes the attention implementation each step ran with."""

    def __init__(self):
        from transformers import TrainerCallback

        seen = self.seen = []

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                seen.append(model.config._attn_implementation)

        self.callback = Callback()


def test_a_few_steps_lower_the_loss_and_save_a_checkpoint_that_reloads_patched(setup, tmp_path):
    model, data = setup
    recorder = Recorder()
    result = finetune(
        model, "rte", tmp_path / "out", attention=SMALL, lora=False, max_steps=12, batch_size=8,
        learning_rate=2e-3, data_dir=data, callbacks=[recorder.callback],
    )  # fmt: skip
    assert recorder.seen == [ATTENTION_NAME] * 12  # clustered attention in the loop, every step
    assert train_loss(tmp_path / "out", data) < 0.8 * train_loss(model, data)
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert reloaded.config._attn_implementation == ATTENTION_NAME
    assert reloaded.config.clustered_attention["clusters"] == 2
    document = json.loads((tmp_path / "out" / "finetune.json").read_text())
    assert [entry["step"] for entry in document["loss_curve"]] == list(range(1, 13))
    assert document["settings"]["attention"]["clusters"] == 2 and document["settings"]["lora"] is False
    assert document["environment"]["git"] is not None or document["environment"]["date"]
    assert result.steps == 12 and (tmp_path / "out" / "loss.png").is_file()
    import bert_cluster

    assert bert_cluster.finetune is finetune  # the function, not shadowed by its package once loaded


def test_exact_trains_and_saves_with_the_unmodified_attention(setup, tmp_path):
    model, data = setup
    recorder = Recorder()
    finetune(
        model, "rte", tmp_path / "out", exact=True, lora=False, max_steps=2, batch_size=8, data_dir=data,
        callbacks=[recorder.callback],
    )  # fmt: skip
    assert recorder.seen and ATTENTION_NAME not in recorder.seen
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "clustered_attention" not in config
    with pytest.raises(ValueError, match="exact"):
        finetune(model, "rte", tmp_path / "other", exact=True, attention={"clusters": 3}, data_dir=data)


def test_lora_trains_the_adapters_and_head_and_saves_merged_weights(setup, tmp_path):
    model, data = setup
    common = {"attention": SMALL, "max_steps": 3, "batch_size": 8, "data_dir": data, "learning_rate": 1e-2}
    finetune(model, "rte", tmp_path / "lora", lora=True, lora_rank=4, **common)
    finetune(model, "rte", tmp_path / "full", lora=False, **common)
    before = load_file(model / "model.safetensors")
    lora, full = (load_file(tmp_path / name / "model.safetensors") for name in ("lora", "full"))
    assert set(lora) == set(before) == set(full)  # merged: no adapter weights left in the checkpoint
    embeddings = "bert.embeddings.word_embeddings.weight"
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(lora[embeddings], before[embeddings])  # not a Linear layer: frozen under LoRA
    assert not torch.equal(lora[query], before[query])  # the merged adapter
    assert not torch.equal(lora["classifier.weight"], before["classifier.weight"])  # the head, trained
    assert not torch.equal(full[embeddings], before[embeddings])


SCRIPT = """
import json, sys, time
from transformers import TrainerCallback
from bert_cluster.finetuning import finetune

model, out, data, mode = sys.argv[1:5]
steps = []

class Steps(TrainerCallback):  # the steps this process ran; in "slow" mode, a second each after step 4
    def on_train_begin(self, args, state, control, **kwargs):
        self.began = time.monotonic()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.monotonic() - self.began

    def on_step_end(self, args, state, control, **kwargs):
        steps.append(state.global_step)
        if mode == "slow" and state.global_step >= 4:
            time.sleep(1.0)

seen = Steps()
result = finetune(model, "rte", out, data_dir=data, resume=mode == "resume", callbacks=[seen], **ARGUMENTS)
print(json.dumps({"resumed_from": result.resumed_from, "steps": steps, "loss_curve": result.loss_curve,
                  "train_seconds": result.train_seconds, "this_process": seen.seconds}))
"""


@pytest.mark.slow(reason="two fine-tuning runs in subprocesses, one killed with -9 and resumed")
def test_resume_after_kill_9_ends_at_the_uninterrupted_run_s_weights_bit_for_bit(setup, tmp_path):
    """Every run a fresh process, as a user's would be: the test process's state (its thread count,
    what earlier tests loaded) cannot make one side compute differently."""
    model, data = setup
    arguments = {"attention": SMALL, "lora": True, "lora_rank": 4, "max_steps": 10, "batch_size": 4,
                 "save_steps": 2, "learning_rate": 5e-3, "seed": 3}  # fmt: skip
    script = textwrap.dedent(SCRIPT).replace("ARGUMENTS", repr(arguments))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def start(out: Path, mode: str) -> subprocess.Popen:
        command = [sys.executable, "-c", script, str(model), str(out), str(data), mode]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def finish(process: subprocess.Popen) -> dict:
        output, error = process.communicate(timeout=300)
        assert process.returncode == 0, error.decode()[-2000:]
        return json.loads(output.decode().strip().splitlines()[-1])

    killed = tmp_path / "killed"
    process = start(killed, "slow")
    helpers.kill_when_written(process, killed / "checkpoints" / "checkpoint-4" / "trainer_state.json", 120)
    assert not (killed / "finetune.json").exists()  # killed mid-run, not after it
    clocks = {  # each complete checkpoint's training time (the resumed run rotates them away)
        state.parent.name: json.loads(state.read_text())["stateful_callbacks"]["TrainingClock"]["attributes"]
        for state in (killed / "checkpoints").glob("checkpoint-*/trainer_state.json")
    }
    resumed = finish(start(killed, "resume"))
    whole = finish(start(tmp_path / "whole", "plain"))
    assert resumed["resumed_from"] in ("checkpoint-4", "checkpoint-6", "checkpoint-8")
    assert whole["resumed_from"] is None and whole["steps"] == list(range(1, 11))
    first = int(resumed["resumed_from"].split("-")[1]) + 1
    assert resumed["steps"] == list(range(first, 11))  # only the steps left ran
    assert resumed["loss_curve"] == whole["loss_curve"]
    # The training time counts both parts: the killed part's to its checkpoint (steps 4 onwards slept a
    # second each before their checkpoints), and the resumed part's.
    before = clocks[resumed["resumed_from"]]["seconds_before"]
    assert before >= first - 4  # steps 4 .. first - 1 slept
    # The callbacks' begin and end a few microseconds apart from the clock's (measured: under 1e-4 s).
    assert resumed["train_seconds"] == pytest.approx(before + resumed["this_process"], abs=0.01)
    assert whole["train_seconds"] == pytest.approx(whole["this_process"], abs=0.01)
    after, reference = (
        load_file(killed / "model.safetensors"),
        load_file(tmp_path / "whole" / "model.safetensors"),
    )
    assert set(after) == set(reference)
    different = [name for name in reference if not torch.equal(after[name], reference[name])]
    assert different == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--task", "qnli"], "has no train split"),
        (["--task", "rte", "--exact", "--clusters", "3"], "--exact trains with the unmodified attention"),
        (["--task", "rte", "--epochs", "1", "--max-steps", "3"], "not both"),
        (["--task", "rte", "--max-steps", "0"], "max_steps must be positive"),
        (["--task", "rte", "--clusters", "10,25"], "takes one cluster count"),
        (["--task", "rte", "--resume"], "nothing to resume"),
        (["--task", "rte", "--resume", "--overwrite"], "not both"),
        (["--task", "rte", "--learning-rate", "-1"], "learning_rate must be positive"),
        (["--task", "rte", "--max-length", "600", "--full"], "--max-length 600 is more than model"),
        (
            ["--task", "rte", "--lora", "--full"],
            "give --lora (the default) or --full (every weight), not both",
        ),
        (
            ["--task", "rte", "--full", "--lora"],
            "give --lora (the default) or --full (every weight), not both",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(setup, tmp_path, arguments, message):
    model, data = setup
    output = tmp_path / "out"
    result = runner.invoke(
        app, ["finetune", str(model), "-o", str(output), "--data-dir", str(data), *arguments]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not output.exists()  # nothing written


def test_a_non_empty_output_is_refused_unless_overwrite_or_resume(setup, tmp_path):
    model, data = setup
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = runner.invoke(
        app, ["finetune", str(model), "-t", "rte", "-o", str(tmp_path / "out"), "--data-dir", str(data)]
    )
    assert result.exit_code == 2 and "is not empty" in result.stderr and "--overwrite" in result.stderr
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
