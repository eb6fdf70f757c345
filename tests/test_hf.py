"""convert / revert on every supported family, the transformers glue, and a real pretrained BERT."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from families import tiny_model

import bert_cluster

FAMILIES = ["bert", "roberta", "distilbert", "electra", "albert", "xlm-roberta", "camembert"]


def padded_batch(pad_id: int, length: int = 48, valid=(48, 37)):
    torch.manual_seed(1)
    ids = torch.randint(5, 120, (len(valid), length))
    mask = torch.zeros(len(valid), length, dtype=torch.long)
    for row, n in enumerate(valid):
        mask[row, :n] = 1
        ids[row, n:] = pad_id
    return ids, mask


def run(model, ids, mask):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_converts_and_runs_a_padded_batch(family):
    model = tiny_model(family)
    ids, mask = padded_batch(model.config.pad_token_id)
    reference = run(model, ids, mask).last_hidden_state
    bert_cluster.convert(model, clusters=4, topk=64)  # k >= N: exact, so the whole model must match
    assert model.config._attn_implementation == "bert_cluster"
    exact = run(model, ids, mask).last_hidden_state
    for row, n in enumerate((48, 37)):  # measured: at most 1.8e-6 over the families
        assert (exact[row, :n] - reference[row, :n]).abs().max() < 1e-5
    bert_cluster.convert(model, clusters=4, topk=3, min_length=0)  # now really approximate
    approx = run(model, ids, mask).last_hidden_state
    assert torch.isfinite(approx).all()
    assert (approx[0] - reference[0]).abs().max() > 0.1  # measured: 0.80 to 2.29
    # a padded row gives what the same row gives alone (right padding keeps position ids); measured 0.0
    alone = run(model, ids[1:, :37], mask[1:, :37]).last_hidden_state
    assert (approx[1, :37] - alone[0]).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_revert_restores_outputs_bit_for_bit(family):
    model = tiny_model(family)
    ids, mask = padded_batch(0)
    before = run(model, ids, mask).last_hidden_state
    original = model.config._attn_implementation
    bert_cluster.convert(model, clusters=3, topk=2, min_length=0)
    bert_cluster.convert(
        model, clusters=5, topk=2, min_length=0
    )  # converting twice still reverts to the original
    assert not torch.equal(run(model, ids, mask).last_hidden_state, before)
    bert_cluster.revert(model)
    assert model.config._attn_implementation == original
    assert not hasattr(model.config, "clustered_attention")
    assert torch.equal(run(model, ids, mask).last_hidden_state, before)


def test_layers_selects_which_layers_are_patched():
    model = tiny_model("bert")
    ids, mask = padded_batch(0)
    before = run(model, ids, mask).hidden_states
    bert_cluster.convert(model, clusters=3, topk=2, layers=[1], min_length=0)
    after = run(model, ids, mask).hidden_states
    assert torch.allclose(after[1], before[1], atol=1e-6)  # layer 0 untouched
    assert (after[2] - before[2]).abs().max() > 1e-4  # layer 1 patched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_stay_finite(dtype):
    model = tiny_model("bert").to(dtype)
    ids, mask = padded_batch(0)
    bert_cluster.convert(model, clusters=4, topk=3, min_length=0)
    out = run(model, ids, mask).last_hidden_state
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_save_and_reload_keeps_the_patch(tmp_path):
    model = tiny_model("bert")
    bert_cluster.convert(model, clusters=4, topk=3, seed=5, min_length=0)
    ids, mask = padded_batch(0)
    expected = run(model, ids, mask).last_hidden_state
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m/config.json").read_text())
    assert saved["clustered_attention"]["clusters"] == 4 and saved["clustered_attention"]["seed"] == 5
    torch.save({"ids": ids, "mask": mask, "expected": expected}, tmp_path / "io.pt")
    # A fresh interpreter: import bert_cluster first, then transformers, as a user would.
    script = textwrap.dedent(f"""
        import torch, bert_cluster
        from transformers import AutoModel
        io = torch.load({str(tmp_path / "io.pt")!r})
        model = AutoModel.from_pretrained({str(tmp_path / "m")!r}).eval()
        assert model.config._attn_implementation == "bert_cluster", model.config._attn_implementation
        with torch.inference_mode():
            out = model(input_ids=io["ids"], attention_mask=io["mask"]).last_hidden_state
        print(float((out - io["expected"]).abs().max()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) == 0.0


@pytest.mark.parametrize("family", ["deberta-v2", "mpnet"])
def test_families_outside_the_attention_interface_are_refused(family):
    model = tiny_model(family)
    with pytest.raises(ValueError, match="supported families: bert, roberta, distilbert"):
        bert_cluster.convert(model)
    assert not hasattr(model.config, "clustered_attention")


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"clusters": 0}, ValueError, "clusters must be >= 1, got 0"),
        ({"topk": 0}, ValueError, "topk must be >= 1"),
        ({"bits": 64}, ValueError, r"bits must be in 1\.\.63, got 64"),
        ({"bits": 0}, ValueError, r"bits must be in 1\.\.63"),
        ({"iterations": 0}, ValueError, "iterations must be >= 1"),
        ({"mode": "fast"}, ValueError, "mode must be one of i-clustered, clustered, got 'fast'"),
        ({"layers": [2]}, ValueError, r"layer index\(es\) \[2\] out of range: this model has layers 0\.\.1"),
        ({"clusters": 2.5}, TypeError, "clusters must be an int"),
        ({"backend": "tpu"}, ValueError, "backend must be one of"),
    ],
)
def test_bad_arguments_are_refused_at_convert_time(settings, error, message):
    model = tiny_model("bert")
    with pytest.raises(error, match=message):
        bert_cluster.convert(model, **settings)
    assert model.config._attn_implementation == "sdpa"


def test_not_a_model_is_a_type_error():
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel"):
        bert_cluster.convert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not converted"):
        bert_cluster.revert(tiny_model("bert"))


def test_albert_shares_its_layers_so_layers_must_be_none():
    with pytest.raises(ValueError, match="shares one attention module"):
        bert_cluster.convert(tiny_model("albert"), layers=[0])


def test_output_attentions_is_refused_clearly():
    model = tiny_model("bert")
    bert_cluster.convert(model, clusters=2)
    ids, mask = padded_batch(0)
    with pytest.raises(ValueError, match="output_attentions"), torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_sequence_classification_head_runs_in_training_mode():
    model = tiny_model("bert", head="cls").train()
    bert_cluster.convert(model, clusters=3, topk=2, min_length=0)
    ids, mask = padded_batch(0)
    out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
    out.loss.backward()  # the reference backend is differentiable
    assert model.classifier.weight.grad is not None and torch.isfinite(model.classifier.weight.grad).all()


# --- a real pretrained BERT ----------------------------------------------------------------------


def mean_pooled(model, tokenizer, texts, max_length=256):
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


@pytest.mark.data
def test_real_minilm_sentence_embeddings_stay_close(shared_dir, minilm_dir):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()
    lines = (shared_dir / "data/glue/STS-B/dev.tsv").read_text(encoding="utf-8").splitlines()[1:65]
    sentences = [line.split("\t")[7] for line in lines]
    squad = json.loads((shared_dir / "data/squad/dev-v1.1.json").read_text())
    paragraphs = [p["context"] for article in squad["data"][:8] for p in article["paragraphs"][:4]]

    plain_short = mean_pooled(model, tokenizer, sentences)
    plain_long = mean_pooled(model, tokenizer, paragraphs)
    bert_cluster.convert(model, clusters=25, topk=32, min_length=0)
    short = mean_pooled(model, tokenizer, sentences)
    long = mean_pooled(model, tokenizer, paragraphs)
    bert_cluster.revert(model)

    # STS-B sentences are shorter than 32 tokens: rows <= C are exact, and k = 32 >= N covers the rest.
    assert (short * plain_short).sum(-1).min() > 0.99999  # measured 0.9999998
    # SQuAD paragraphs (median ~150 tokens) are really approximated.
    # measured (32 paragraphs of 41-217 tokens, C=25, k=32): mean cosine 0.9961, min 0.9868 with seed 0
    # (seeds 1 and 2: mean 0.9958 / 0.9955, min 0.9758 / 0.9790)
    cosine = (long * plain_long).sum(-1)
    assert cosine.mean() > 0.99
    assert cosine.min() > 0.97
    assert cosine.mean() < 0.99999  # and the approximation was really exercised


def test_torch_compile_traces_a_patched_model_without_graph_breaks():
    model = tiny_model("bert")
    bert_cluster.convert(model, clusters=4, topk=3, min_length=0)
    ids, mask = padded_batch(0)
    eager = run(model, ids, mask).last_hidden_state
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    with torch.inference_mode():
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(out, eager)
