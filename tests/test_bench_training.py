"""benchmarks.training: the results' schema, and every ratio taken from the same run's timings."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import transformers

from benchmarks import training


def load_bench():
    return training


@pytest.fixture()
def tiny_bench(monkeypatch):
    """The script with the proxy replaced by a small random BERT classifier and its processes run here."""
    bench = load_bench()

    def build_training_model(job):
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=300,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=2,
            attention_probs_dropout_prob=0.1 if job.get("attention_dropout") else 0.0,
        )
        model = transformers.BertForSequenceClassification(config)
        model.config._attn_implementation = "sdpa"

        def inputs(length, document):
            generator = torch.Generator().manual_seed(document)
            return torch.randint(5, 300, (1, length), generator=generator)

        return model, inputs

    monkeypatch.setattr(bench, "build_training_model", build_training_model)
    monkeypatch.setattr(bench, "run_job", lambda job, timeout: json.loads(json.dumps(bench.worker(job))))
    monkeypatch.setattr(bench, "WARMUP_TOKENS", 8)
    return bench


def ratio_of_medians(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(numerator) / statistics.median(denominator)


def test_results_schema_and_ratios_from_the_same_run(tiny_bench, tmp_path):
    output = tmp_path / "training.json"
    argv = ["--lengths", "32", "48", "--dtypes", "fp32", "--repeats", "3", "--train-lengths", "40"]
    argv += ["--train-repeats", "3", "--profile-lengths", "40", "--no-memory", "--output", str(output)]
    assert tiny_bench.main(argv) == 0
    result = json.loads(output.read_text())
    assert {"date", "machine", "environment", "kernels", "targets", "settings", "attention", "step"} <= set(
        result
    )
    assert result["machine"]["threads"] == 2 and len(result["machine"]["load_average_before"]) == 3
    assert result["targets"]["attention_speedup"] == {"2048": 4.0, "8192": 20.0}
    assert result["targets"]["step_speedup"] == {"4096": 2.0, "16384": 3.5}

    rows = result["attention"]["rows"]
    assert [(r["n"], r["method"]) for r in rows] == [(n, m) for n in (32, 48) for m in tiny_bench.METHODS]
    for row in rows:
        sdpa = next(r for r in rows if r["n"] == row["n"] and r["method"] == "sdpa")
        assert len(row["times_ms"]) == 3  # one time per round, every method in every round
        assert row["speedup_vs_sdpa"] == pytest.approx(ratio_of_medians(sdpa["times_ms"], row["times_ms"]))
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert "target_speedup" not in row  # no target at these lengths
        if row["method"] != "sdpa":
            assert row["record_met"] == (row["record_over_infer"] <= 1.2)

    (step,) = result["step"]["rows"]
    assert step["length"] == 40 and step["errors"] == {}
    times = step["times_s"]
    assert set(times) == {"sdpa", "patched", "free"} and all(len(t) == 3 for t in times.values())
    assert step["speedup"] == pytest.approx(ratio_of_medians(times["sdpa"], times["patched"]))
    assert step["bound"] == pytest.approx(ratio_of_medians(times["sdpa"], times["free"]))
    assert step["patched_attention_s"] == pytest.approx(step["patched_s"] - step["free_s"])
    assert set(step["profile"]) == {"sdpa", "patched"}
    assert step["profile"]["sdpa"]["top"][0]["self_s"] > 0
    assert output.with_suffix(".png").stat().st_size > 0


def test_targets_and_memory_verdicts(tiny_bench):
    timing = {"times_s": {"sdpa": [8.0, 9.0, 10.0], "patched": [4.0, 4.0, 5.0], "free": [3.0, 3.0, 3.0]}}
    memory = {"sdpa": {"extra_mib": 100.0}, "patched": {"extra_mib": 101.0}}
    row = tiny_bench.step_row(4096, timing, memory)
    assert (row["speedup"], row["target_speedup"], row["speedup_met"]) == (9.0 / 4.0, 2.0, True)
    assert row["memory_met"] is False  # one MiB higher is higher
    missed = tiny_bench.step_row(16384, timing, {})
    assert (missed["target_speedup"], missed["speedup_met"]) == (3.5, False)
    assert "memory_met" not in missed


def test_a_training_steps_memory_is_measured_in_its_own_process(tiny_bench):
    job = {"threads": 1, "mode": "memory", "length": 64, "variant": "patched", "convert": {}}
    out = tiny_bench.worker(job)
    assert out["extra_mib"] == pytest.approx(out["peak_rss_mib"] - out["rss_before_mib"])
    assert out["extra_mib"] >= 0 and out["step_s"] > 0


def test_attention_rounds_are_interleaved(monkeypatch):
    bench = load_bench()
    calls: list[tuple[str, str]] = []

    def case(method, n, dtype, dropout=0.0):
        def call(kind):
            def run():
                calls.append((method, kind) if not dropout else (method, kind, dropout))
                return (0.0, 0.0) if kind == "train" else 0.0

            return run

        kinds = ["train"] if method == "sdpa" or dropout else ["train", "infer", "record"]
        return {kind: call(kind) for kind in kinds}

    monkeypatch.setattr(bench, "attention_case", case)
    bench.time_attention([64], ["fp32"], ["sdpa", "kernel-i-clustered"], repeats=2, dropouts=[0.0, 0.1])
    one_round = [("sdpa", "train"), *(("kernel-i-clustered", k) for k in ("train", "infer", "record"))]
    one_round += [("sdpa", "train", 0.1), ("kernel-i-clustered", "train", 0.1)]
    assert calls == one_round * 3  # the warm-up, then every method and dropout once per round


def test_dropout_rows_compare_within_the_same_rounds(tiny_bench, tmp_path):
    """--dropout 0 0.1: each method with and without dropout; x SDPA against SDPA with the same dropout,
    "over_no_dropout" the median of the per-round ratios; targets and recording only without dropout."""
    output = tmp_path / "dropout.json"
    argv = ["--parts", "attention", "--lengths", "40", "--dtypes", "fp32", "--repeats", "3"]
    argv += ["--dropout", "0", "0.1", "--no-memory", "--output", str(output)]
    assert tiny_bench.main(argv) == 0
    result = json.loads(output.read_text())
    assert result["attention"]["dropouts"] == [0.0, 0.1]
    rows = result["attention"]["rows"]
    assert [(r["dropout"], r["method"]) for r in rows] == [
        (p, m) for p in (0.0, 0.1) for m in tiny_bench.METHODS
    ]
    found = {(r["dropout"], r["method"]): r for r in rows}
    for (p, method), row in found.items():
        sdpa = found[(p, "sdpa")]
        assert row["speedup_vs_sdpa"] == pytest.approx(ratio_of_medians(sdpa["times_ms"], row["times_ms"]))
        if p:
            plain = found[(0.0, method)]["times_ms"]
            per_round = [a / b for a, b in zip(row["times_ms"], plain, strict=True)]
            assert row["over_no_dropout"] == pytest.approx(statistics.median(per_round))
            assert "record_over_infer" not in row
        else:
            assert "over_no_dropout" not in row
            assert ("record_over_infer" in row) == (method != "sdpa")


def test_dropout_values_are_checked(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--parts", "attention", "--dropout", "0", "1.0"])
    assert exit_info.value.code == 2
    assert "--dropout takes distinct probabilities in [0, 1)" in capsys.readouterr().err


def test_ratios_need_sdpa_in_the_run(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--parts", "attention", "--methods", "kernel-i-clustered"])
    assert exit_info.value.code == 2
    assert "--methods must include sdpa" in capsys.readouterr().err
