"""A converted checkpoint loaded without ``import bert_cluster``: transformers' refusal says what to do.

transformers quotes the attention implementation's name and nothing else (issue 69: "bert_cluster is not
supported", no hint), so the name saved in config.json carries the hint; the name earlier versions saved
still loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import helpers

from bert_cluster import ClusteredAttentionConfig
from bert_cluster.checkpoints import convert_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def load_fresh(folder: Path, first: str = "") -> subprocess.CompletedProcess:
    """``from_pretrained(folder)`` in a new process, after ``first`` (an import, or nothing)."""
    code = f"""
        {first}
        from transformers import AutoModelForSequenceClassification
        model = AutoModelForSequenceClassification.from_pretrained({str(folder)!r})
        print(model.config._attn_implementation)
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


def test_loading_without_import_says_to_import_bert_cluster_and_with_it_loads(tmp_path):
    model = helpers.save_model(tmp_path / "model")
    converted = convert_checkpoint(model, tmp_path / "converted", ClusteredAttentionConfig(clusters=2))
    refused = load_fresh(converted)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: Specified `attn_implementation=") and "is not supported" in last
    assert "(import bert_cluster before from_pretrained)" in last, last
    loaded = load_fresh(converted, "import bert_cluster")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert (
        loaded.stdout.strip().splitlines()[-1] == "bert_cluster (import bert_cluster before from_pretrained)"
    )


def test_a_checkpoint_saved_under_the_earlier_name_still_loads(tmp_path):
    model = helpers.save_model(tmp_path / "model")
    converted = convert_checkpoint(model, tmp_path / "converted", ClusteredAttentionConfig(clusters=2))
    config = json.loads((converted / "config.json").read_text())
    config["attn_implementation"] = "bert_cluster"  # as bert-cluster 0.2.0 saved it
    (converted / "config.json").write_text(json.dumps(config))
    loaded = load_fresh(converted, "import bert_cluster")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip().splitlines()[-1] == "bert_cluster"
