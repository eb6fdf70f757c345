"""Data-parallel evaluation: two CPU processes (gloo) under ``accelerate launch`` score as one does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

from bert_cluster.parallel import Workers, length_sorted_batches

STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
STSB_ROWS = [
    ("A man is playing a guitar.", "A person plays the guitar.", "4.6"),
    ("A cat sleeps on the sofa.", "The dog runs in the park.", "0.4"),
    ("Two children are reading books.", "Kids read.", "3.8"),
    ("The sun rises in the east every morning.", "Stock prices fell sharply on Monday.", "0.0"),
    ("A woman is slicing an onion.", "Someone cuts an onion with a knife.", "4.2"),
    ("He drove to work.", "He walked to the beach with his friends in the late afternoon.", "1.0"),
    ("The train was late.", "The train did not arrive on time.", "4.8"),
    ("Birds fly south in winter.", "In winter, many birds migrate to warmer places.", "3.9"),
    ("A boy kicks a ball.", "A girl plays the piano.", "0.8"),
    ("Rain is expected tomorrow.", "It will probably rain tomorrow.", "4.5"),
    ("The museum opens at nine.", "Cheese is made from milk.", "0.1"),
    ("She bought a new red car last week.", "Last week she purchased a red car.", "4.4"),
]


def test_batches_are_shared_round_robin_and_outputs_come_back_in_order():
    batches = length_sorted_batches([3, 9, 1, 7, 5], 2)
    assert batches == [[1, 3], [4, 0], [2]]
    workers = Workers()
    outputs = workers.map(lambda batch: [item * 10 for item in batch], [0, 1, 2, 3, 4], [3, 9, 1, 7, 5], 2)
    assert outputs == [0, 10, 20, 30, 40]
    assert workers.timing.items == 5 and workers.timing.tokens == 25 and workers.timing.warmed_up


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    """Three tiny models (regression, sentence-transformer, QA) and their data in the original layouts."""
    root = tmp_path_factory.mktemp("parallel")
    helpers.save_model(root / "models" / "tiny-stsb", labels=None, num_labels=1)
    helpers.save_sentence_transformer(root / "models" / "tiny-stsb-embedding")
    helpers.save_model(root / "models" / "tiny-squad", head="qa", labels=None)
    (root / "data" / "STS-B").mkdir(parents=True)
    lines = [STSB_HEADER] + [
        f"{i}\tg\tf\ty\t{i}\ts\ts\t{a}\t{b}\t{s}" for i, (a, b, s) in enumerate(STSB_ROWS)
    ]
    (root / "data" / "STS-B" / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    paragraphs = [
        {
            "context": f"{a} {b} The answer is number {i}.",
            "qas": [
                {
                    "id": f"q{i}",
                    "question": "What is the answer?",
                    "answers": [{"text": f"{i}", "answer_start": 0}],
                }
            ],
        }
        for i, (a, b, _) in enumerate(STSB_ROWS)
    ]
    squad = {"data": [{"title": "t", "paragraphs": paragraphs}]}
    (root / "data" / "dev-v1.1.json").write_text(json.dumps(squad), encoding="utf-8")
    return root


def _evaluate(bench: Path, output: Path, launcher: list[str]) -> dict:
    arguments = [
        *("-m", "bert_cluster", "evaluate", str(bench / "models" / "tiny-{task}")),
        *(
            "--task",
            "stsb,stsb-embedding,squad",
            "--clusters",
            "2,3",
            "--batch-size",
            "3",
            "--max-length",
            "160",
        ),
        *("--data-dir", str(bench / "data"), "--output", str(output), "--quiet"),
    ]
    # One thread per process in both runs, so the only difference is the number of processes.
    # Gloo on loopback: the interface it picks from the host name may not connect (see test_training).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([*launcher, *arguments], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((output / "results.json").read_text(encoding="utf-8"))


@pytest.mark.slow(reason="a real checkpoint scored by one process and by two")
def test_two_processes_score_exactly_like_one(bench, tmp_path):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    one = _evaluate(bench, tmp_path / "one", [sys.executable])
    two = _evaluate(
        bench,
        tmp_path / "two",
        [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        + ["--mixed_precision", "no", "--dynamo_backend", "no"],
    )
    assert (
        two["environment"]["hardware"]["processes"] == 2 and one["environment"]["hardware"]["processes"] == 1
    )
    for first, second in zip(one["tasks"], two["tasks"], strict=True):
        assert first["status"] == second["status"] == "ok", (first["error"], second["error"])
        assert [run["processes"] for run in second["runs"]] == [2, 2, 2]
        # The same batches, split between the processes and gathered back: the same scores, to the bit.
        assert [run["scores"] for run in first["runs"]] == [run["scores"] for run in second["runs"]], first[
            "task"
        ]
        assert all(run["tokens_per_s"] > 0 and run["speedup"] > 0 for run in second["runs"])
    # Only the first process writes: the folder holds one run's files, nothing else.
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "results.json",
        "results.md",
        "scores.png",
    ]
