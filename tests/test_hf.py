"""convert / revert on every supported family, the transformers glue, and a real pretrained BERT."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from families import ALSO_ROUTED, HALF_WINDOW, HYBRID, REFUSED, SUPPORTED, tiny_config, tiny_model

import bert_cluster
from bert_cluster.hf import ATTENTION_NAME

LENGTHS = (48, 37, 29)  # valid tokens per row; clusters=3 < 29, so every row is really clustered


def padded_batch(model, side: str = "right", lengths=LENGTHS, width: int = 48):
    """Token ids, attention mask and (left padding) position ids counting from each row's first token."""
    generator = torch.Generator().manual_seed(1)
    pad = model.config.pad_token_id
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    positions = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        span = slice(0, n) if side == "right" else slice(width - n, width)
        ids[row, span] = torch.randint(5, 120, (n,), generator=generator)
        mask[row, span] = 1
        positions[row, span] = torch.arange(n)
    return ids, mask, (positions if side == "left" else None)


def run(model, ids, mask, positions=None, **kwargs):
    extra = {} if positions is None else {"position_ids": positions}
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **extra, **kwargs)


def valid_rows(hidden, mask):
    """The valid positions of each row (padding outputs are unspecified)."""
    return [hidden[row][mask[row].bool()] for row in range(hidden.shape[0])]


def max_difference(a, b, mask):
    pairs = zip(valid_rows(a, mask), valid_rows(b, mask), strict=True)
    return max(float((x - y).abs().max()) for x, y in pairs)


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_family_is_exact_when_topk_covers_every_key(family):
    model = tiny_model(family)
    ids, mask, _ = padded_batch(model)
    reference = run(model, ids, mask).last_hidden_state
    bert_cluster.convert(
        model, clusters=4, topk=64, min_length=0
    )  # k >= N: exact, so the whole model must match
    assert model.config._attn_implementation == ATTENTION_NAME
    exact = run(model, ids, mask).last_hidden_state
    # measured: at most 3.5e-6 over the families (float32 summation order); hybrid families' local layers
    # go through the exact band, their global layers through clustering with k >= N
    assert max_difference(exact, reference, mask) < 2e-5
    bert_cluster.convert(model, clusters=3, topk=3, min_length=0)  # now really approximate
    approx = run(model, ids, mask).last_hidden_state
    assert torch.isfinite(approx).all()
    assert max_difference(approx, reference, mask) > 0.05  # measured: 0.27 (NeoMME) to 4.2 (EuroBERT)


@pytest.mark.parametrize("family", ALSO_ROUTED)
def test_further_families_on_the_interface_convert_exactly_and_revert(family):
    model = tiny_model(family)
    ids, mask, _ = padded_batch(model)
    reference = run(model, ids, mask).last_hidden_state
    bert_cluster.convert(model, clusters=4, topk=64, min_length=0)
    assert max_difference(run(model, ids, mask).last_hidden_state, reference, mask) < 2e-5  # measured 2e-6
    bert_cluster.convert(model, clusters=3, topk=3, min_length=0)
    assert max_difference(run(model, ids, mask).last_hidden_state, reference, mask) > 0.05  # measured 0.34+
    bert_cluster.revert(model)
    assert torch.equal(run(model, ids, mask).last_hidden_state, reference)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_a_padded_row_equals_the_row_alone(family, side):
    model = bert_cluster.convert(tiny_model(family), clusters=3, topk=3, seed=7, min_length=0)
    ids, mask, positions = padded_batch(model, side)
    batch = run(model, ids, mask, positions).last_hidden_state
    for row in range(len(LENGTHS)):
        keep = mask[row].bool()
        alone_positions = None if positions is None else positions[row : row + 1, keep]
        alone = run(model, ids[row : row + 1, keep], mask[row : row + 1, keep], alone_positions)
        # Same clusters; only the float32 summation order differs (a batch's GEMMs block otherwise).
        # Measured: at most 2.4e-6 with MKL's AVX-512 kernels, 4.5e-5 with its AVX2 ones (electra;
        # MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 on the Xeon).
        assert float((batch[row][keep] - alone.last_hidden_state[0]).abs().max()) < 1e-4


def test_an_unpadded_batch_holds_no_mask_and_a_padded_one_its_own(monkeypatch):
    """Like transformers' own SDPA path: nothing padded, no mask (none held through the forward pass)."""
    from bert_cluster import hf

    seen = []
    original = hf.clustered_attention
    monkeypatch.setattr(
        hf,
        "clustered_attention",
        lambda q, k, v, valid, *a, **kw: seen.append(valid) or original(q, k, v, valid, *a, **kw),
    )
    model = bert_cluster.convert(tiny_model("bert"), clusters=3, topk=3, seed=7, min_length=0)
    ids, mask, _ = padded_batch(model)
    run(model, ids, torch.ones_like(mask))
    assert seen and all(valid is None for valid in seen)
    seen.clear()
    run(model, ids, mask)
    assert seen and all(torch.equal(valid, mask.bool()) for valid in seen)


@pytest.mark.parametrize("family", SUPPORTED)
def test_revert_restores_outputs_bit_for_bit(family):
    model = tiny_model(family)
    ids, mask, _ = padded_batch(model)
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
    assert not hasattr(model.config, "attn_implementation")
    assert torch.equal(run(model, ids, mask).last_hidden_state, before)


@pytest.mark.parametrize("family", SUPPORTED)
def test_save_and_from_pretrained_keep_the_patch(family, tmp_path):
    from transformers import AutoModel

    model = bert_cluster.convert(tiny_model(family), clusters=3, topk=3, seed=5, min_length=0)
    ids, mask, _ = padded_batch(model)
    expected = run(model, ids, mask).last_hidden_state
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == ATTENTION_NAME
    assert reloaded.config.clustered_attention["seed"] == 5
    assert torch.equal(run(reloaded, ids, mask).last_hidden_state, expected)


def test_save_and_reload_in_a_fresh_interpreter(tmp_path):
    model = tiny_model("bert")
    bert_cluster.convert(model, clusters=4, topk=3, seed=5, min_length=0)
    ids, mask, _ = padded_batch(model)
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
        assert model.config._attn_implementation == {ATTENTION_NAME!r}, model.config._attn_implementation
        with torch.inference_mode():
            out = model(input_ids=io["ids"], attention_mask=io["mask"]).last_hidden_state
        print(float((out - io["expected"]).abs().max()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) == 0.0


# --- the output at the transformers boundary --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["clustered", "i-clustered", "i-clustered+"])
def test_the_attention_function_hands_over_the_ops_output_without_a_copy(mode):
    # transformers takes attention's output as (B, L, H, D); the fused CPU op writes that memory, so the
    # function returns the op's own result, bit for bit, and copies nothing (a transposing copy cost 3.7
    # ms of 18 at 4,096 tokens x 12 heads x 64).
    from torch.profiler import ProfilerActivity, profile

    from bert_cluster import attention, dispatch, ops
    from bert_cluster.hf import attention_forward, settings_of

    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"cpu kernels unavailable: {why}")
    model = bert_cluster.convert(
        tiny_model("bert"), clusters=4, topk=8, min_length=0, mode=mode, backend="cpu"
    )
    module = bert_cluster.hf.attention_modules(model)[1]
    torch.manual_seed(3)
    query, key, value = torch.randn(3, 2, 4, 64, 16).unbind(0)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, 50:] = False
    attention_forward(module, query, key, value, valid, scaling=0.25)  # plans and hash planes made once
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        out, _ = attention_forward(module, query, key, value, valid, scaling=0.25)
    config, _ = settings_of(model.config)
    clusters, topk = config.row_settings(64)
    expected = ops.clustered_heads(
        query, key, value, valid, *attention.step_arguments(config, clusters, topk, 0.25, 1, query)
    )
    assert out.shape == (2, 64, 4, 16) and out.is_contiguous()
    assert torch.equal(out, expected.transpose(1, 2))
    assert expected.transpose(1, 2).is_contiguous()  # the op's own layout: (B, L, H, D) memory
    copies = [event.key for event in profiled.key_averages() if event.key in ("aten::copy_", "aten::clone")]
    assert not copies, copies


@pytest.mark.parametrize("rows", ["clustered", "exact", "exact-padded", "mixed"])
def test_the_compiled_op_returns_the_layout_its_fake_promises(rows):
    # torch.compile (inductor) asserts a custom op's output strides against its fake's: every route
    # (the fused op, SDPA, padded exact rows, a mix) must give the (B, L, H, D) memory the fake says.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bert_cluster import attention
    from bert_cluster.config import number_of

    torch.manual_seed(4)
    query, key, value = torch.randn(3, 2, 4, 40, 8).unbind(0)
    valid = torch.ones(2, 40, dtype=torch.bool)
    if rows in ("exact-padded", "mixed"):
        valid[1, 3:] = False  # 3 valid tokens: at most C, so exact attention
    config = bert_cluster.ClusteredAttentionConfig(clusters=4, topk=5, min_length=0)
    if rows.startswith("exact"):
        config = bert_cluster.ClusteredAttentionConfig(clusters=4, topk=5, min_length=100)
    args = (query, key, value, valid, number_of(config), 8**-0.5, 0, 0.0, 0)  # layer 0, no dropout
    out = attention._clustered_attention_op(*args)
    with FakeTensorMode() as mode:
        fake = attention._clustered_attention_op(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        )
    assert out.shape == fake.shape == (2, 4, 40, 8)
    assert out.stride() == fake.stride() == (40 * 4 * 8, 8, 4 * 8, 1)


# --- sliding-window (hybrid) families ------------------------------------------------------------------


def banded_sdpa(query, key, value, valid, half_window):
    """Exact attention under the band |i - j| <= half_window, with torch's SDPA (the oracle)."""
    positions = torch.arange(query.shape[-2])
    band = (positions[:, None] - positions[None, :]).abs() <= half_window
    allowed = band & valid[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed)


def test_a_sliding_window_layer_runs_the_exact_band_of_modernbert():
    # ModernBERT passes sliding_window = half window + 1 (flash convention) and masks |i - j| <= half window.
    from bert_cluster.hf import attention_forward

    model = bert_cluster.convert(tiny_model("modernbert"), clusters=2, topk=2, min_length=0)
    local = model.layers[1].attn
    assert local.sliding_window == HALF_WINDOW + 1
    torch.manual_seed(2)
    query, key, value = torch.randn(3, 2, 4, 30, 8).unbind(0)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, 21:] = False
    out, _ = attention_forward(
        local, query, key, value, valid, scaling=8**-0.5, sliding_window=HALF_WINDOW + 1
    )
    out = out.transpose(1, 2)
    right = banded_sdpa(query, key, value, valid, HALF_WINDOW)
    wider = banded_sdpa(query, key, value, valid, HALF_WINDOW + 1)
    assert float((out[0] - right[0]).abs().max()) < 1e-5
    assert float((out[1, :, :21] - right[1, :, :21]).abs().max()) < 1e-5
    assert float((out[0] - wider[0]).abs().max()) > 1e-2  # an off-by-one window would show


@pytest.mark.parametrize("family", HYBRID)
def test_layers_selects_global_and_local_layers_of_hybrid_models(family):
    model = tiny_model(family)
    kinds = model.config.layer_types
    ids, mask, _ = padded_batch(model)
    before = run(model, ids, mask).hidden_states
    global_layer = kinds.index("full_attention")
    local_layer = kinds.index("sliding_attention")
    first = min(global_layer, local_layer)
    # a local layer alone: the band is exact, so the model barely moves (measured 1.4e-6)
    bert_cluster.convert(model, clusters=2, topk=2, layers=[local_layer], min_length=0)
    after = run(model, ids, mask).hidden_states
    assert max_difference(after[-1], before[-1], mask) < 2e-5
    # a global layer alone: clustered; the layers before it are untouched, bit for bit
    bert_cluster.convert(model, clusters=2, topk=2, layers=[global_layer], min_length=0)
    after = run(model, ids, mask).hidden_states
    assert torch.equal(after[global_layer], before[global_layer])
    assert max_difference(after[global_layer + 1], before[global_layer + 1], mask) > 1e-3
    if first < global_layer:
        assert torch.equal(after[first + 1], before[first + 1])


def test_long_xlm_roberta_positions_like_bge_m3():
    # BGE-M3 is XLM-RoBERTa with 8,194 positions; its glue is XLM-R's. Past BERT's 512 tokens, still exact at
    # k >= N and padding-safe.
    import transformers as T

    config = T.XLMRobertaConfig(**{**tiny_config("xlm-roberta").to_dict(), "max_position_embeddings": 8194})
    torch.manual_seed(0)
    model = T.XLMRobertaModel(config).eval()
    ids, mask, _ = padded_batch(model, lengths=(700, 611), width=700)
    reference = run(model, ids, mask).last_hidden_state
    bert_cluster.convert(model, clusters=8, topk=700, min_length=0)
    assert max_difference(run(model, ids, mask).last_hidden_state, reference, mask) < 2e-5  # measured 2.4e-6


# --- families that cannot be patched, and bad settings ------------------------------------------------


@pytest.mark.parametrize("family", REFUSED)
def test_families_outside_the_attention_interface_are_refused_with_the_reason(family):
    model = tiny_model(family)
    with pytest.raises(ValueError, match=rf"model family '{family}' .*computes attention in its own code"):
        bert_cluster.convert(model)
    assert not hasattr(model.config, "clustered_attention")
    assert model.config._attn_implementation != ATTENTION_NAME


def test_decoders_are_refused():
    import transformers as T

    decoder = T.AutoModel.from_config(T.BertConfig(**{**tiny_config("bert").to_dict(), "is_decoder": True}))
    with pytest.raises(ValueError, match=r"model family 'bert' .*decoder"):
        bert_cluster.convert(decoder)
    causal = T.AutoModel.from_config(
        T.ModernBertDecoderConfig(
            vocab_size=120,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=16,
            pad_token_id=0,
        )
    )
    with pytest.raises(ValueError, match=r"'modernbert-decoder' .*causal \(is_causal=True\)"):
        bert_cluster.convert(causal)


def test_a_vision_encoder_is_refused():
    import transformers as T

    config = T.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    vit = T.ViTModel(config)
    with pytest.raises(ValueError, match=r"'vit' .*not a text encoder \(it takes pixel_values\)"):
        bert_cluster.convert(vit)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"clusters": 0}, ValueError, "clusters must be >= 1, got 0"),
        ({"topk": 0}, ValueError, "topk must be >= 1"),
        ({"bits": 64}, ValueError, r"bits must be in 1\.\.63, got 64"),
        ({"bits": 0}, ValueError, r"bits must be in 1\.\.63"),
        ({"iterations": 0}, ValueError, "iterations must be >= 1"),
        ({"mode": "fast"}, ValueError, "mode must be one of"),
        ({"layers": [2]}, ValueError, r"layer index\(es\) \[2\] out of range: this model has layers 0\.\.1"),
        ({"layers": []}, ValueError, r"layers=\[\] patches no layer"),
        ({"clusters": 2.5}, TypeError, "clusters must be an int"),
        ({"backend": "tpu"}, ValueError, "backend must be one of"),
        (
            {"clusterz": 3},
            TypeError,
            r"unknown clustered attention setting\(s\) \['clusterz'\]; allowed: clusters, topk",
        ),
        ({"config": bert_cluster.ClusteredAttentionConfig(), "clusters": 25}, TypeError, "not both"),
        ({"config": 25}, TypeError, "config must be a bert_cluster.ClusteredAttentionConfig"),
        ({"config": {"clusters": 4}}, TypeError, r"config must be a bert_cluster.ClusteredAttentionConfig"),
        (
            {"config": bert_cluster.ClusteredAttentionConfig(), "topk": 8},
            TypeError,
            r"either config= or keyword settings, not both \(got config= and \['topk'\]\)",
        ),
        ({"config": bert_cluster.ClusteredAttentionConfig(layers=())}, ValueError, "patches no layer"),
    ],
)
def test_bad_arguments_are_refused_at_convert_time(settings, error, message):
    model = tiny_model("bert")
    with pytest.raises(error, match=message):
        bert_cluster.convert(model, **settings)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model.config, "clustered_attention")


def test_not_a_model_is_a_type_error():
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel .* sentence_transformers"):
        bert_cluster.convert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not converted"):
        bert_cluster.revert(tiny_model("bert"))


def test_albert_shares_its_layers_so_layers_must_be_none():
    with pytest.raises(ValueError, match=r"'albert' .*shares 1 attention module\(s\) across its 2 layers"):
        bert_cluster.convert(tiny_model("albert"), layers=[0])


def test_layers_selects_which_layers_are_patched():
    model = tiny_model("bert")
    ids, mask, _ = padded_batch(model)
    before = run(model, ids, mask).hidden_states
    bert_cluster.convert(model, clusters=3, topk=2, layers=[1], min_length=0)
    after = run(model, ids, mask).hidden_states
    assert torch.equal(after[1], before[1])  # layer 0 untouched: its own implementation and mask
    assert max_difference(after[2], before[2], mask) > 1e-2  # layer 1 patched


# --- settings and state (issue 11 items 7 and 8) -------------------------------------------------------


def test_output_attentions_is_refused_in_the_call_and_in_the_config():
    import transformers as T

    model = bert_cluster.convert(tiny_model("bert"), clusters=2, min_length=0)
    ids, mask, _ = padded_batch(model)
    with pytest.raises(ValueError, match="output_attentions"):
        run(model, ids, mask, output_attentions=True)
    config = tiny_config("bert")
    config.output_attentions = True  # transformers accepts this for eager models only
    torch.manual_seed(0)
    model = bert_cluster.convert(T.BertModel(config).eval(), clusters=2, min_length=0)
    with pytest.raises(ValueError, match="output_attentions"):  # silently gave attentions == () before
        run(model, ids, mask)
    assert run(model, ids, mask, output_attentions=False).attentions is None  # the call overrides the config


def test_in_place_edits_of_the_settings_take_effect():
    model = bert_cluster.convert(tiny_model("bert"), clusters=3, topk=2, min_length=0)
    ids, mask, _ = padded_batch(model)
    first = run(model, ids, mask).last_hidden_state
    model.config.clustered_attention["clusters"] = 6  # ignored before (settings cached by the dict's id)
    edited = run(model, ids, mask).last_hidden_state
    fresh = run(
        bert_cluster.convert(tiny_model("bert"), clusters=6, topk=2, min_length=0), ids, mask
    ).last_hidden_state
    assert not torch.equal(edited, first)
    assert torch.equal(edited, fresh)
    model.config.clustered_attention["clusters"] = 0
    with pytest.raises(ValueError, match="clustered_attention is invalid: clusters must be >= 1, got 0"):
        run(model, ids, mask)


def test_convert_patches_only_the_model_converted_when_two_share_a_config():
    import transformers as T

    config = tiny_config("bert")
    torch.manual_seed(0)
    first, second = T.BertModel(config).eval(), T.BertModel(config).eval()
    ids, mask, _ = padded_batch(first)
    before = run(second, ids, mask).last_hidden_state
    bert_cluster.convert(first, clusters=2, topk=2, min_length=0)
    assert first.config._attn_implementation == ATTENTION_NAME
    assert second.config._attn_implementation == "sdpa"
    assert not hasattr(config, "clustered_attention")
    assert torch.equal(run(second, ids, mask).last_hidden_state, before)
    assert all(module.config is first.config for module in bert_cluster.hf.attention_modules(first))


# --- training, dtypes, compile -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_stay_finite(dtype):
    model = tiny_model("bert").to(dtype)
    ids, mask, _ = padded_batch(model)
    bert_cluster.convert(model, clusters=4, topk=3, min_length=0)
    out = run(model, ids, mask).last_hidden_state
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_sequence_classification_head_runs_in_training_mode():
    model = tiny_model("bert", head="cls").train()
    bert_cluster.convert(model, clusters=3, topk=2, min_length=0)
    ids, mask, _ = padded_batch(model, lengths=(48, 37))
    out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
    out.loss.backward()  # the reference backend is differentiable
    assert model.classifier.weight.grad is not None and torch.isfinite(model.classifier.weight.grad).all()


def test_torch_compile_traces_a_patched_model_without_graph_breaks():
    model = tiny_model("bert")
    bert_cluster.convert(model, clusters=4, topk=3, min_length=0)
    ids, mask, _ = padded_batch(model)
    eager = run(model, ids, mask).last_hidden_state
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    with torch.inference_mode():
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(out, eager)


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


def test_every_documented_call_form_gives_the_settings_it_names():
    """``convert(model)``: convert's preset; clusters positional or by keyword; or a whole config."""
    from bert_cluster import hf

    preset = bert_cluster.ClusteredAttentionConfig.for_convert()

    def stored(model):
        settings = dict(model.config.clustered_attention)
        settings.pop("original_attn_implementation")
        return bert_cluster.ClusteredAttentionConfig.from_dict(settings)

    assert stored(bert_cluster.convert(tiny_model("bert"))) == preset
    assert stored(bert_cluster.convert(tiny_model("bert"), 7)) == preset.replace(clusters=7)
    assert stored(bert_cluster.convert(tiny_model("bert"), clusters=7, topk=9)) == preset.replace(
        clusters=7, topk=9
    )
    given = bert_cluster.ClusteredAttentionConfig(clusters=3, min_length=0)
    assert stored(bert_cluster.convert(tiny_model("bert"), config=given)) == given
    assert stored(hf.convert(tiny_model("bert"), given)) == given
    assert stored(hf.convert(tiny_model("bert"), mode="clustered")) == preset.replace(mode="clustered")
    with pytest.raises(TypeError, match="not both"):
        bert_cluster.convert(tiny_model("bert"), 7, config=given)
