"""scripts/gpu_check.sh's verdicts, on this CPU machine (the dry runs themselves run in .ci/run).

The GPU run has one chance per lease: a stage that passes while checking nothing (``pytest -m cuda`` with
every test skipped exits 0) would report a GPU as checked that never was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pytest_stage(tmp_path: Path, body: str) -> tuple[int, dict]:
    tests = tmp_path / "cuda_tests"
    tests.mkdir()
    (tests / "test_gpu_only.py").write_text(
        "import pytest\n\n\n@pytest.mark.cuda\ndef test_on_the_gpu():\n" + body + "\n"
    )
    out = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        OUT=str(out),
        PYTHON=sys.executable,
        GPU_CHECK_STAGES="pytest-cuda",
        GPU_CHECK_PYTEST_TARGETS=str(tests),
    )
    env.pop("GPU_CHECK_DEST", None)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "correctness", "--skip-build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = json.loads((out / "summary.json").read_text())
    return proc.returncode, summary


def _status(summary: dict, name: str) -> str:
    return next(stage["status"] for stage in summary["stages"] if stage["stage"] == name)


def test_a_pytest_stage_that_skipped_everything_fails_the_call(tmp_path) -> None:
    returncode, summary = _pytest_stage(tmp_path, "    pytest.skip('needs a CUDA GPU')")
    assert returncode == 1 and not summary["ok"]
    assert _status(summary, "pytest-cuda") == "failed"
    assert summary["pytest"]["skipped"] == 1 and summary["pytest"]["passed"] == 0
    assert any("skipped" in problem for problem in summary["pytest"]["problems"])
    # stages left out by GPU_CHECK_STAGES are reported as skipped, and do not fail the call by themselves
    assert _status(summary, "checks") == "skipped" and _status(summary, "build") == "skipped"


def test_a_pytest_stage_whose_tests_ran_passes(tmp_path) -> None:
    returncode, summary = _pytest_stage(tmp_path, "    assert 1 + 1 == 2")
    assert returncode == 0 and summary["ok"], summary
    assert _status(summary, "pytest-cuda") == "passed"
    assert summary["pytest"]["passed"] == 1 and summary["pytest"]["skipped"] == 0


def test_unknown_call_is_a_usage_error() -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "everything"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "usage: gpu_check.sh correctness|speed" in proc.stderr
