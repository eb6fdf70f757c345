"""benchmarks.finetune_recovery in parts (issue 40, item 2): the results file after every step, ``--resume``
keeping what it holds and continuing an interrupted fine-tuning, and nothing replaced unasked."""

from __future__ import annotations

import json

import helpers
import pytest
from test_finetune import write_train

import bert_cluster
from benchmarks import finetune_recovery
from bert_cluster.finetuning import FinetuneInterrupted

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    helpers.save_model(root / "models" / "minilm-l6-rte")
    data = write_train(root / "data")
    helpers.write_rte(data, helpers.RTE_ROWS)
    return root


def arguments(root, tmp_path, *more: str) -> list[str]:
    return [
        "--models", str(root / "models"), "--tasks", "rte", "--data-dir", str(root / "data"),
        "--train-clusters", "2", "--score-clusters", "2", "--max-steps", "4", "--save-steps", "2",
        "--batch-size", "8", "--max-length", "32", "--work", str(tmp_path / "work"),
        "--output", str(tmp_path / "recovery.json"), *more,
    ]  # fmt: skip


class Calls:
    """bert_cluster.finetune, noting each call's arm, seed and resume flag (and stopping one on request)."""

    def __init__(self, monkeypatch, interrupt_after: int | None = None):
        self.seen: list[tuple[bool, int, bool]] = []
        real = bert_cluster.finetune

        def finetune(model, task, output, **options):
            self.seen.append((options["exact"], options["seed"], options["resume"]))
            if interrupt_after is not None and not self.seen[1:]:
                options["callbacks"] = [Stop(interrupt_after)]
            return real(model, task, output, **options)

        monkeypatch.setattr(bert_cluster, "finetune", finetune)


def Stop(step: int):  # noqa: N802 (a TrainerCallback class made on first use: transformers loads late)
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt

    return StopAt()


def test_a_run_in_parts_keeps_what_it_has_and_adds_the_seeds_asked_for(folders, tmp_path, monkeypatch):
    script = finetune_recovery
    calls = Calls(monkeypatch)
    script.main(arguments(folders, tmp_path, "--seeds", "1"))
    first = json.loads((tmp_path / "recovery.json").read_text())
    entry = first["tasks"]["rte"]
    assert set(entry["original"]["scores"]) == {"unmodified", "C=2"}
    assert set(entry["seeds"]) == {"0"} and set(entry["seeds"]["0"]) == {"clustered", "exact"}
    assert all(run["steps"] == 4 for run in entry["seeds"]["0"].values())
    assert calls.seen == [(False, 0, False), (True, 0, False)]

    calls.seen.clear()
    script.main(arguments(folders, tmp_path, "--seeds", "2", "--resume"))
    second = json.loads((tmp_path / "recovery.json").read_text())
    assert calls.seen == [(False, 1, False), (True, 1, False)]  # seed 0 neither trained nor scored again
    assert second["tasks"]["rte"]["original"] == entry["original"]
    assert second["tasks"]["rte"]["seeds"]["0"] == entry["seeds"]["0"]
    assert set(second["tasks"]["rte"]["seeds"]["1"]) == {"clustered", "exact"}
    assert second["settings"]["seeds"] == 2 and len(second["parts"]) == 1


def test_an_interrupted_fine_tuning_continues_from_its_checkpoint(folders, tmp_path, monkeypatch):
    script = finetune_recovery
    Calls(monkeypatch, interrupt_after=3)
    with pytest.raises(FinetuneInterrupted):
        script.main(arguments(folders, tmp_path))
    partial = json.loads((tmp_path / "recovery.json").read_text())
    assert "original" in partial["tasks"]["rte"] and partial["tasks"]["rte"]["seeds"] == {}  # saved before

    monkeypatch.undo()
    calls = Calls(monkeypatch)
    script.main(arguments(folders, tmp_path, "--resume"))
    assert calls.seen == [(False, 0, True), (True, 0, False)]  # from checkpoint-2, the control afresh
    finished = json.loads((tmp_path / "work" / "rte-clustered-seed0" / "finetune.json").read_text())
    assert finished["steps"] == 4 and finished["resumed_from"].endswith("checkpoint-2")


def test_nothing_is_replaced_unasked_and_a_resume_keeps_the_settings(folders, tmp_path, monkeypatch):
    script = finetune_recovery
    output = tmp_path / "recovery.json"
    with pytest.raises(SystemExit, match="does not exist; run without --resume"):
        script.main(arguments(folders, tmp_path, "--resume"))
    output.write_text('{"kept": true}\n')
    with pytest.raises(SystemExit, match="exists: --resume to continue it"):
        script.main(arguments(folders, tmp_path))
    assert output.read_text() == '{"kept": true}\n'

    output.unlink()
    Calls(monkeypatch)
    script.main(arguments(folders, tmp_path))
    before = output.read_text()
    with pytest.raises(SystemExit, match="other settings.*learning_rate"):
        script.main(arguments(folders, tmp_path, "--resume", "--learning-rate", "1e-3"))
    assert output.read_text() == before


def test_a_clustered_arm_scored_before_the_revert_fix_is_scored_again(folders, tmp_path, monkeypatch):
    """A clustered arm without notes was scored "unmodified" as its saved C: --resume scores it again from
    its fine-tuning in --work (reverted: the notes name the saved settings), training nothing."""
    script = finetune_recovery
    Calls(monkeypatch)
    script.main(arguments(folders, tmp_path, "--seeds", "1"))
    output = tmp_path / "recovery.json"
    document = json.loads(output.read_text())
    arms = document["tasks"]["rte"]["seeds"]["0"]
    assert arms["clustered"]["notes"]["saved converted"].startswith("i-clustered+ C=2")
    assert "saved converted" not in arms["exact"]["notes"]
    scored = arms["clustered"]["scores"]
    del arms["clustered"]["notes"]
    arms["clustered"]["scores"] = {"unmodified": {"accuracy": -1.0}}
    output.write_text(json.dumps(document))

    calls = Calls(monkeypatch)
    script.main(arguments(folders, tmp_path, "--seeds", "1", "--resume"))
    again = json.loads(output.read_text())["tasks"]["rte"]["seeds"]["0"]
    assert calls.seen == []
    assert again["clustered"]["scores"] == scored and "saved converted" in again["clustered"]["notes"]
    assert again["exact"] == arms["exact"]


def test_distill_reaches_each_arm_and_arms_runs_only_those_named(folders, tmp_path, monkeypatch):
    script = finetune_recovery
    calls = Calls(monkeypatch)
    script.main(arguments(folders, tmp_path, "--seeds", "1", "--distill", "1", "--arms", "clustered"))
    document = json.loads((tmp_path / "recovery.json").read_text())
    assert calls.seen == [(False, 0, False)]  # the exact arm not run
    assert set(document["tasks"]["rte"]["seeds"]["0"]) == {"clustered"}
    trained = json.loads((tmp_path / "work" / "rte-clustered-seed0" / "finetune.json").read_text())
    assert trained["settings"]["distill"] == 1.0
    # The other arm in a later part: --arms may change between parts, --distill may not.
    script.main(arguments(folders, tmp_path, "--seeds", "1", "--distill", "1", "--arms", "exact", "--resume"))
    assert calls.seen == [(False, 0, False), (True, 0, False)]
    with pytest.raises(SystemExit, match="other settings"):
        script.main(arguments(folders, tmp_path, "--seeds", "1", "--resume"))


def test_a_results_file_from_before_distill_resumes_as_undistilled(folders, tmp_path, monkeypatch):
    script = finetune_recovery
    calls = Calls(monkeypatch)
    script.main(arguments(folders, tmp_path, "--seeds", "1"))
    path = tmp_path / "recovery.json"
    document = json.loads(path.read_text())
    for key in ("distill", "distill_temperature", "arms"):
        del document["settings"][key]  # as the files of 2026-12-04 and -05 were written
    path.write_text(json.dumps(document))
    script.main(arguments(folders, tmp_path, "--seeds", "2", "--resume"))
    assert calls.seen[2:] == [(False, 1, False), (True, 1, False)]


def test_the_control_that_moves_keeps_its_dropout_and_every_arm_records_how_far_it_moved(
    folders, tmp_path, monkeypatch
):
    """Issue 67: the exact-dropout arm distils with the student's dropout on (the exact arm has no distance
    to learn from), each arm records its weights' displacement from the checkpoint, and --score-seeds scores
    every C with each hash seed."""
    script = finetune_recovery
    with pytest.raises(SystemExit):  # dropout is on anyway when fine-tuning on the labels
        script.main(arguments(folders, tmp_path, "--arms", "exact-dropout"))
    calls = Calls(monkeypatch)
    more = ("--seeds", "1", "--distill", "1", "--arms", "exact", "exact-dropout", "--score-seeds", "0", "1")
    script.main(arguments(folders, tmp_path, *more))
    assert calls.seen == [(True, 0, False), (True, 0, False)]
    arms = json.loads((tmp_path / "recovery.json").read_text())["tasks"]["rte"]["seeds"]["0"]
    assert set(arms) == {"exact", "exact-dropout"}
    for name, dropout in (("exact", False), ("exact-dropout", True)):
        trained = json.loads((tmp_path / "work" / f"rte-{name}-seed0" / "finetune.json").read_text())
        assert trained["settings"]["distill_dropout"] is dropout and trained["settings"]["attention"] is None
        moved = arms[name]["displacement"]
        assert moved["all"] == pytest.approx((moved["encoder"] ** 2 + moved["head"] ** 2) ** 0.5)
        assert set(arms[name]["scores"]) == {"unmodified", "C=2 seed=0", "C=2 seed=1"}
    # Without dropout the student starts at its teacher: a distance of float rounding; with it, dropout's.
    assert arms["exact"]["final_loss"] < 1e-4 < arms["exact-dropout"]["final_loss"]
    assert arms["exact-dropout"]["displacement"]["all"] > 0
