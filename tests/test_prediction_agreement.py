"""benchmarks.prediction_agreement: the distance of fine-tuned models from their checkpoint's predictions."""

from __future__ import annotations

import json
import shutil

import helpers
import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks import prediction_agreement


def test_the_checkpoint_agrees_with_itself_and_a_changed_head_does_not(tmp_path):
    checkpoint = helpers.save_model(tmp_path / "minilm-l6-rte")
    data = tmp_path / "data"
    helpers.write_rte(data, helpers.RTE_ROWS)
    work = tmp_path / "work"
    same, changed = work / "rte-exact-seed0", work / "rte-clustered-seed0"
    for folder in (same, changed):
        shutil.copytree(checkpoint, folder)
        (folder / "finetune.json").write_text("{}")
    weights = load_file(changed / "model.safetensors")
    weights["classifier.bias"] = weights["classifier.bias"] + torch.tensor([3.0, -3.0])  # class 0 always
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    script = prediction_agreement
    output = tmp_path / "agreement.json"
    arguments = ["--checkpoint", str(checkpoint), "--task", "rte", "--work", str(work), "--clusters", "2"]
    script.main([*arguments, "--data-dir", str(data), "--output", str(output)])
    document = json.loads(output.read_text())
    models = document["models"]
    assert set(models) == {"checkpoint", "rte-exact-seed0", "rte-clustered-seed0"}
    assert models["checkpoint"]["unmodified"]["kl_mean"] == 0.0
    assert models["checkpoint"]["unmodified"]["agreement"] == 100.0
    assert models["rte-exact-seed0"] == models["checkpoint"]  # the same weights: the same figures
    shifted = models["rte-clustered-seed0"]["unmodified"]
    assert shifted["kl_mean"] > 0.1 and shifted["kl_max"] >= shifted["kl_median"] > 0
    assert document["examples"] == len(helpers.RTE_ROWS)
    assert document["mean_over_seeds"]["rte-clustered"]["unmodified"]["kl_mean"] == shifted["kl_mean"]
    with pytest.raises(SystemExit, match="exists"):
        script.main([*arguments, "--data-dir", str(data), "--output", str(output)])
