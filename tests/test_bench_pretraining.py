"""The masked-LM experiment's verdict on constructed results (issue 67, item 3): the gate, the targets, a
missing seed; the table and its verdict lines; the plot. No training here: the runs live in the benchmark."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import pretraining

BUDGETS = [300.0, 600.0, 900.0, 1200.0]


def arm(losses: dict[float, float], seconds_per_step: float, rescored: bool = False) -> dict:
    marks = {}
    for budget, loss in losses.items():
        mark = {"step": int(budget / seconds_per_step), "seconds": budget, "loss": loss}
        if rescored:
            mark["loss_exact_attention"] = loss + 0.05
        marks[f"{budget:g}"] = mark
    steps = int(max(losses) / seconds_per_step)
    return {
        "marks": marks,
        "steps": steps,
        "train_seconds": steps * seconds_per_step,
        "seconds_per_step": seconds_per_step,
        "train_loss": [[1, 6.0], [steps, 2.0]],
        "clock": [[1, seconds_per_step], [steps, steps * seconds_per_step]],
    }


def result(exact: list[dict[float, float]], clustered: list[dict[float, float]]) -> dict:
    """Seeds 0.. with the given losses per budget (0 s at 6.0 added to each)."""
    seeds = {}
    for seed, (e, c) in enumerate(zip(exact, clustered, strict=True)):
        seeds[str(seed)] = {
            "placement": {"placement": "parallel"},
            "exact": arm({0.0: 6.0, **e}, 9.0),
            "clustered": arm({0.0: 6.0, **c}, 3.5, rescored=True),
        }
    return {
        "settings": {"seeds": list(range(len(exact))), "budgets": BUDGETS, "length": 4096, "model": "tiny"},
        "seeds": seeds,
    }


def falling(start: float, step: float, noise: float = 0.0) -> dict[float, float]:
    return {budget: start - step * index + noise for index, budget in enumerate(BUDGETS)}


def test_the_gate_and_targets_scale_with_the_budgets():
    assert pretraining.judged_budgets(BUDGETS) == (600.0, 1200.0, (600.0, 900.0, 1200.0))  # the issue's
    assert pretraining.judged_budgets([1200, 2400, 3600, 4800]) == (2400, 4800, (2400, 3600, 4800))
    with pytest.raises(ValueError, match="half the longest"):
        pretraining.judged_budgets([300, 700])


def test_every_target_met_supports_the_claim():
    exact = [falling(3.5, 0.2, noise) for noise in (0.0, 0.01, -0.01)]
    clustered = [falling(3.0, 0.2, noise) for noise in (0.0, 0.01, -0.01)]  # 0.5 lower everywhere
    found = pretraining.verdict(result(exact, clustered))
    assert found["gate"]["passed"]
    assert found["gate"]["fall"] == pytest.approx(0.4)
    assert all(entry["met"] for entry in found["at_most_exact"].values())
    assert found["reach"]["met"]  # clustered at 10 min: 2.8 <= exact at 20 min: 2.9
    assert found["status"] == "supported"


def test_a_failed_gate_decides_nothing_whatever_the_arms_show():
    flat = [{300.0: 3.0, 600.0: 2.95, 900.0: 2.93, 1200.0: 2.9} for _ in range(3)]  # falls 0.05 < 0.1
    better = [{budget: 2.0 for budget in BUDGETS} for _ in range(3)]
    found = pretraining.verdict(result(flat, better))
    assert not found["gate"]["passed"]
    assert found["status"] == "not decided"


def test_the_gate_needs_the_fall_above_five_seed_deviations():
    # mean fall 0.4, but the seeds spread 0.1 at 20 min: 0.4 < 5 x 0.1
    exact = [falling(3.5, 0.2, noise) for noise in (0.0, 0.0, 0.0)]
    for seed, shift in enumerate((-0.1, 0.0, 0.1)):
        exact[seed][1200.0] += shift
    clustered = [falling(3.0, 0.2) for _ in range(3)]
    found = pretraining.verdict(result(exact, clustered))
    assert found["gate"]["seed_std"] == pytest.approx(0.1)
    assert not found["gate"]["passed"]
    assert found["status"] == "not decided"


def test_one_seed_can_fail_the_gate_but_not_pass_it():
    flat = {300.0: 3.78, 600.0: 3.73, 900.0: 3.66, 1200.0: 3.69}  # seed 0 at the first size: fell 0.04
    found = pretraining.verdict(result([flat], [flat]))
    assert found["status"] == "not decided" and found["gate"]["seed_std"] is None
    assert "one seed: no std" in "\n".join(pretraining.pretraining_table([result([flat], [flat])]))
    found = pretraining.verdict(result([falling(3.5, 0.2)], [falling(3.0, 0.2)]))
    assert found["status"] == "incomplete" and found["gate"]["fall"] == pytest.approx(0.4)


def test_one_seed_above_exact_is_not_supported():
    exact = [falling(3.5, 0.2, noise) for noise in (0.0, 0.01, -0.01)]
    clustered = [falling(3.0, 0.2) for _ in range(3)]
    clustered[2][900.0] = exact[2][900.0] + 0.01  # seed 2 above exact at 15 min: the mean is still lower
    found = pretraining.verdict(result(exact, clustered))
    assert found["gate"]["passed"]
    assert found["at_most_exact"]["900"]["mean"] < 0
    assert not found["at_most_exact"]["900"]["met"]
    assert found["at_most_exact"]["600"]["met"] and found["at_most_exact"]["1200"]["met"]
    assert found["status"] == "not supported"


def test_reaching_exacts_last_loss_late_is_not_supported():
    exact = [falling(3.5, 0.2, noise) for noise in (0.0, 0.01, -0.01)]
    clustered = [falling(3.45, 0.2) for _ in range(3)]  # lower than exact everywhere, by 0.05
    found = pretraining.verdict(result(exact, clustered))
    assert all(entry["met"] for entry in found["at_most_exact"].values())
    assert not found["reach"]["met"]  # 3.25 at 10 min against exact's 2.9 at 20
    assert found["status"] == "not supported"


def test_a_missing_seed_or_budget_is_incomplete():
    exact = [falling(3.5, 0.2) for _ in range(3)]
    clustered = [falling(3.0, 0.2) for _ in range(3)]
    constructed = result(exact, clustered)
    del constructed["seeds"]["2"]["clustered"]["marks"]["1200"]
    found = pretraining.verdict(constructed)
    assert found["status"] == "incomplete"
    assert found["missing"] == ["seed 2 clustered at 1200 s"]
    del constructed["seeds"]["1"]
    assert pretraining.verdict(constructed)["status"] == "incomplete"
    assert "Verdict: **incomplete**" in "\n".join(pretraining.pretraining_table([constructed]))


def test_the_table_shows_each_seeds_difference_and_the_verdict():
    exact = [falling(3.5, 0.2, noise) for noise in (0.0, 0.01, -0.01)]
    clustered = [falling(3.0, 0.2, noise) for noise in (0.0, 0.01, -0.01)]
    lines = pretraining.pretraining_table([result(exact, clustered)])
    text = "\n".join(lines)
    row = next(line for line in lines if line.startswith("| 10 min"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:4] == ["3.300 ± 0.010", "2.800 ± 0.010", "-0.500"]  # exact, clustered, seed 0's difference
    assert cells[4:7] == ["-0.500", "-0.500", "-0.500 ± 0.000"]  # seeds 1, 2 and their mean +- std
    assert cells[7:] == ["66 / 171", "2.850 ± 0.010"]  # steps; clustered scored with exact attention
    assert "Validity gate (passed)" in text
    assert "**Verdict: supported.**" in text
    assert "step of exact took 2.57x" in text  # 9.0 s against 3.5 s


def test_the_plot_and_results_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    constructed = result([falling(3.5, 0.2)] * 2, [falling(3.0, 0.2)] * 2)
    path = tmp_path / "pretraining.png"
    pretraining.plot(constructed, path)
    assert path.stat().st_size > 10_000
    json.dumps(pretraining.verdict(constructed))  # the verdict is plain data, written into the results file


def test_each_arm_is_one_finetune_run_with_its_attention(tmp_path):
    args = argparse.Namespace(
        model=tmp_path / "model.json", task="sympy-mlm", budgets=[300.0, 600.0], learning_rate=1e-3,
        warmup_steps=50, batch_size=2, save_steps=100, length=4096, attention_dropout=0.0,
    )  # fmt: skip
    exact = pretraining.arm_command("exact", 1, tmp_path / "exact", args)
    clustered = pretraining.arm_command("clustered", 1, tmp_path / "clustered", args)
    assert exact[exact.index("--eval-at") + 1] == "0,300,600"
    assert exact[exact.index("--max-seconds") + 1] == "600"
    assert exact[-1] == "--exact" and clustered[-1] == "--eval-exact"
    assert exact[:-1][: exact.index("-o")] == clustered[: clustered.index("-o")]  # the same run but the arm


def finetune_report(marks: dict[float, tuple[int, float]], seconds_per_step: float, exact: bool) -> dict:
    steps = max(step for step, _ in marks.values())
    evaluations = []
    for mark, (step, loss) in marks.items():
        entry = {"mark": mark, "seconds": mark, "step": step, "scores": {"loss": loss}}
        if not exact:
            entry["exact_attention"] = {"loss": loss + 0.1}
        evaluations.append(entry)
    return {
        "evaluations": evaluations,
        "steps": steps,
        "train_seconds": steps * seconds_per_step,
        "loss_curve": [{"step": s, "loss": 4.0 - s / 1000} for s in range(1, steps + 1)],
        "clock_curve": [{"step": s, "seconds": s * seconds_per_step} for s in range(1, steps + 1)],
        "settings": {"exact": exact, "seed": 0, "max_length": 4096},
        "environment": {"hardware": {"torch_threads": 1}},
    }


def test_finished_runs_are_read_not_retrained_into_results_table_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    launched = []
    monkeypatch.setattr(pretraining, "launch", lambda *a, **k: launched.append(a))
    for seed in (0, 1):
        for arm, per_step, start in (("exact", 9.0, 3.5), ("clustered", 3.5, 3.2)):
            folder = tmp_path / "work" / f"seed{seed}" / arm
            folder.mkdir(parents=True)
            marks = {b: (int(b / per_step), start - b / 1000 + seed / 100) for b in (0.0, 60.0, 120.0)}
            report = finetune_report(marks, per_step, arm == "exact")
            (folder / "finetune.json").write_text(json.dumps(report), encoding="utf-8")
    output = tmp_path / "out" / "pretraining.json"
    argv = ["--seeds", "0", "1", "--budgets", "60", "120", "--work", str(tmp_path / "work")]
    assert pretraining.main([*argv, "--output", str(output)]) == 0
    assert launched == []
    written = json.loads(output.read_text(encoding="utf-8"))
    assert written["seeds"]["1"]["clustered"]["marks"]["120"]["loss"] == pytest.approx(3.2 - 0.12 + 0.01)
    assert written["seeds"]["0"]["exact"]["seconds_per_step"] == pytest.approx(9.0)
    assert written["verdict"]["status"] == "not decided"  # exact fell 0.06 from 1 to 2 minutes
    assert (written["verdict"]["gate"]["from"], written["verdict"]["gate"]["to"]) == (60.0, 120.0)
    assert output.with_suffix(".png").stat().st_size > 10_000
    assert "| 2 min |" in output.with_suffix(".md").read_text(encoding="utf-8")
