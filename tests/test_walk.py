"""The path of a setting from ``bert-cluster evaluate --clusters`` to the kernel (issue 70, item 5).

The cluster counts are parsed once; the config object ``convert`` stores on the model is the one every
forward reads (no dict parsed back on the forward, eagerly or under torch.compile); ``model.config`` keeps
its serialisable copy, so saving, reloading and reverting work as before.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from families import tiny_model

import bert_cluster
from bert_cluster import evaluation, hf
from bert_cluster.config import ClusteredAttentionConfig


def padded_batch(width: int = 40):
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 120, (2, width), generator=generator)
    mask = torch.ones(2, width, dtype=torch.long)
    mask[1, 27:] = 0
    return ids, mask


def forward(model, ids, mask):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


class Stop(Exception):
    """Raised by the patched runner once it has the plan."""


def test_the_cluster_counts_are_parsed_once(monkeypatch, tmp_path):
    parsed, plans = [], []
    parse = evaluation.parse_clusters
    monkeypatch.setattr(evaluation, "parse_clusters", lambda value: parsed.append(value) or parse(value))

    def run_plan(plan, *args):
        plans.append(plan)
        raise Stop

    monkeypatch.setattr(evaluation.runner, "run_plan", run_plan)
    with pytest.raises(Stop):
        evaluation.run(str(helpers.save_model(tmp_path / "cls")), "rte", clusters="10,25,10")
    assert parsed == ["10,25,10"]  # twice before: checked, then parsed again for the plan
    assert plans[0].clusters == (10, 25)


def test_the_forward_reads_the_config_object_convert_stored(monkeypatch):
    config = ClusteredAttentionConfig(clusters=3, topk=4, min_length=0)
    model = bert_cluster.convert(tiny_model("bert"), config=config)
    stored = model.config.clustered_attention
    assert isinstance(stored, dict) and stored["clusters"] == 3  # the serialisable copy
    read = []
    attend = hf.clustered_attention

    def spy(query, key, value, valid, settings, **kwargs):
        read.append(settings)
        return attend(query, key, value, valid, settings, **kwargs)

    monkeypatch.setattr(hf, "clustered_attention", spy)
    monkeypatch.setattr(ClusteredAttentionConfig, "from_dict", None)  # no dict parsed back
    forward(model, *padded_batch())
    assert read and all(settings is config for settings in read)  # equal copies before, one per model


def test_no_config_is_built_on_a_compiled_forward(monkeypatch):
    model = bert_cluster.convert(tiny_model("bert"), clusters=3, topk=4, min_length=0)
    ids, mask = padded_batch()
    eager = forward(model, ids, mask)
    built = []
    post_init = ClusteredAttentionConfig.__post_init__

    def counted(self):
        built.append(self)
        post_init(self)

    monkeypatch.setattr(ClusteredAttentionConfig, "__post_init__", counted)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(forward(compiled, ids, mask), eager, rtol=0, atol=0)
    assert built == []  # before: a config rebuilt from the op's fields in every layer's call


def test_a_saved_model_reloads_its_settings_once_and_reverts_bit_for_bit(tmp_path):
    from transformers import AutoModel

    model = tiny_model("bert")
    ids, mask = padded_batch()
    plain = forward(model, ids, mask)
    bert_cluster.convert(model, clusters=3, topk=4, min_length=0)
    converted = forward(model, ids, mask)
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(reloaded.config.clustered_attention) is dict  # as saved: JSON
    torch.testing.assert_close(forward(reloaded, ids, mask), converted, rtol=0, atol=0)
    settings, original = hf.settings_of(reloaded.config)  # parsed once, on the first forward
    assert hf.settings_of(reloaded.config)[0] is settings and original == "sdpa"
    assert reloaded.config.clustered_attention == model.config.clustered_attention
    bert_cluster.revert(reloaded)
    assert torch.equal(forward(reloaded, ids, mask), plain)
