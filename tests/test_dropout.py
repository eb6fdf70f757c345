"""Attention dropout in training (issue 38, item 2).

The centroids' weights are dropped per (centroid, key), each query's top-k weights per (query, key),
short rows' weights as in exact attention; masks come from one seed drawn from torch's default generator
per call, so ``torch.manual_seed`` fixes them and a forward computed again for the backward (gradient
checkpointing, torch.compile's op) drops the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math

import pytest
import torch
from helpers import kernel_backends, require_kernels, tiny_bert_config

import bert_cluster
from bert_cluster import ClusteredAttentionConfig, clustered_attention, dispatch, reference
from bert_cluster.attention import dropped, hash_planes, step_arguments, windowed_attention

MODES = ["i-clustered+", "i-clustered", "clustered"]


def _inputs(rows=2, heads=2, n=40, dim=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, n, dim, generator=generator, dtype=dtype) for _ in range(3))
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, n - 9 :] = False
    return q, k, v, valid


def _config(mode, backend="reference", **settings):
    return ClusteredAttentionConfig(clusters=4, topk=6, mode=mode, min_length=0, backend=backend, **settings)


def test_the_mask_drops_the_share_asked_and_scales_the_rest():
    weights = torch.rand(2, 3, 100, 200, generator=torch.Generator().manual_seed(0)) + 0.1
    first, second = torch.arange(100)[:, None], torch.arange(200)
    dropped = reference.attention_dropout(weights, 0.3, 1, first, second)
    assert torch.equal(dropped, reference.attention_dropout(weights, 0.3, 1, first, second))
    assert not torch.equal(dropped, reference.attention_dropout(weights, 0.3, 2, first, second))
    kept = dropped != 0
    # 120,000 draws: the dropped share's standard error is 0.0013, so 0.3 +- 0.01 is 7 of them.
    assert abs(1 - kept.float().mean().item() - 0.3) < 0.01
    torch.testing.assert_close(dropped[kept], weights[kept] / 0.7)
    assert reference.attention_dropout(weights, 0.0, 1, first, second) is weights
    # Every (row, head) and every stream has its own mask: no two of the 6 (row, head) masks agree on
    # more than chance (0.7^2 + 0.3^2 = 58% of the pairs), and the centroid stream differs.
    masks = kept.reshape(6, -1).float()
    agreement = (masks[:, None] == masks[None]).float().mean(-1)
    assert agreement[~torch.eye(6, dtype=torch.bool)].max() < 0.6
    other = reference.attention_dropout(weights, 0.3, 1, first, second, reference.CENTROID_STREAM)
    assert not torch.equal(dropped, other)


def test_a_pair_is_dropped_the_same_whatever_computes_it():
    """Counter-based: the draw of (row, head, query, key) does not depend on the shape it is drawn in."""
    shape = torch.Size((2, 3, 40, 40))
    grid = reference.dropout_uniforms(7, 0, shape, torch.arange(40)[:, None], torch.arange(40))
    picks = torch.randint(0, 40, (2, 3, 40, 5), generator=torch.Generator().manual_seed(0))
    gathered = reference.dropout_uniforms(7, 0, picks.shape, torch.arange(40)[:, None], picks)
    assert torch.equal(gathered, grid.gather(-1, picks))
    assert grid.min() >= 0 and grid.max() < 1


@pytest.mark.parametrize("mode", MODES)
def test_dropout_changes_the_output_and_the_seed_fixes_it(mode):
    q, k, v, valid = _inputs()
    config = _config(mode)
    torch.manual_seed(5)
    first = clustered_attention(q, k, v, valid, config, dropout=0.2)
    torch.manual_seed(5)
    same = clustered_attention(q, k, v, valid, config, dropout=0.2)
    other = clustered_attention(q, k, v, valid, config, dropout=0.2)
    plain = clustered_attention(q, k, v, valid, config)
    assert torch.equal(first, same)
    assert not torch.equal(first, other) and not torch.equal(first, plain)
    assert torch.equal(first[1, :, -9:], torch.zeros_like(first[1, :, -9:]))  # padded queries stay zero


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow(reason="thousands of dropout draws, so that the mean's error is below the test's bound")
def test_dropout_is_unbiased(mode):
    """The mean over many masks tends to the output without dropout (each weight enters linearly)."""
    q, k, v, valid = _inputs(heads=1, n=24)
    config = _config(mode)
    plain = clustered_attention(q, k, v, valid, config)
    torch.manual_seed(0)
    draws = torch.stack([clustered_attention(q, k, v, valid, config, dropout=0.3) for _ in range(200)])
    spread = draws.std(0)
    assert spread.max() > 0.05  # the masks do change the output
    # Each element's mean is within 6 standard errors of the plain output (measured: at most 4.1).
    error = (draws.mean(0) - plain).abs()
    assert (error <= 6 * spread / 200**0.5 + 1e-6).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow(reason="gradcheck in float64 through a whole call with dropout")
def test_gradient_through_dropout_passes_gradcheck(mode):
    """The steps with dropout in float64 (the reference's precision for float64; no backend takes it)."""
    q, k, v, valid = _inputs(rows=2, heads=1, n=12, dim=3, dtype=torch.float64)
    config = _config(mode)
    settings = step_arguments(config, config.clusters, config.topk, 0.5, 0, q)

    def attend(q_, k_, v_):
        return dropped(dispatch.ReferenceBackend(), q_, k_, v_, valid, *settings, 0.25, 11)

    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(attend, leaves)


def test_windowed_attention_drops_band_weights_and_passes_gradcheck():
    q, k, v, valid = _inputs(rows=2, heads=1, n=20, dim=4)
    config = ClusteredAttentionConfig(backend="reference")
    plain = windowed_attention(q, k, v, valid, 3, config)
    torch.manual_seed(2)
    dropped = windowed_attention(q, k, v, valid, 3, config, dropout=0.4)
    assert not torch.equal(dropped, plain)
    q, k, v = (t.double() for t in (q, k, v))

    def attend(q_, k_, v_):
        return reference.banded_attention(q_, k_, v_, valid, 3, 0.5, dropout=0.4, seed=2)

    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(attend, leaves)


@pytest.mark.parametrize("backend,device", [("cpu", "cpu")])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_backends_drop_like_the_reference(backend, device, mode):
    """The partition runs on the backend, the dropped weights in its kernels: the reference's masks, the
    same result. (The CUDA kernels have no dropout: test_a_backend_without_dropout_refuses_it.)"""
    require_kernels(backend)
    q, k, v, valid = (t.to(device) for t in _inputs(n=48, seed=3))
    results = []
    for name in ("reference", backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(9)
        out = clustered_attention(*leaves, valid, _config(mode, name), dropout=0.2)
        out.square().sum().backward()
        results.append((out, [t.grad for t in leaves]))
    (ref_out, ref_grads), (out, grads) = results
    # Measured on Zen 4: output 6e-7, gradients 4e-6 apart (the kernels' summation order).
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend,device", kernel_backends())
def test_a_backend_without_dropout_refuses_it(backend, device):
    """Forced, a backend whose kernels have no dropout says so; auto runs such a call where there is one."""
    require_kernels(backend)
    q, k, v, valid = (t.to(device) for t in _inputs(n=48, seed=3))
    config = _config("i-clustered+", backend)
    if dispatch.BACKENDS[backend].HAS_DROPOUT:
        pytest.skip(f"the {backend} kernels have dropout (test_kernel_backends_drop_like_the_reference)")
    with pytest.raises(ValueError, match=f"backend '{backend}' cannot run.*attention dropout"):
        clustered_attention(q, k, v, valid, config, dropout=0.2)
    outputs = []
    for name in ("auto", "reference"):
        torch.manual_seed(9)
        outputs.append(clustered_attention(q, k, v, valid, config.replace(backend=name), dropout=0.2))
    assert torch.equal(*outputs)


def test_short_rows_drop_like_exact_attention():
    q, k, v, valid = _inputs(n=6)  # every row at most C = 25 long: exact attention
    config = ClusteredAttentionConfig(backend="reference")
    torch.manual_seed(4)
    dropped = clustered_attention(q, k, v, valid, config, dropout=0.5)
    plain = clustered_attention(q, k, v, valid, config)
    assert not torch.equal(dropped, plain)
    assert torch.equal(dropped[1, :, -9 + 6 :], torch.zeros_like(dropped[1, :, -3:]))


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 2])
def test_bad_dropout_is_refused(dropout):
    q, k, v, valid = _inputs()
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        clustered_attention(q, k, v, valid, _config("i-clustered"), dropout=dropout)
    with pytest.raises(TypeError, match="dropout must be a float"):
        clustered_attention(q, k, v, valid, _config("i-clustered"), dropout="0.1")


# --- the patched model -------------------------------------------------------------------------------


def _model(attention_dropout: float):
    from transformers import BertForSequenceClassification

    config = tiny_bert_config(num_labels=2)
    config.attention_probs_dropout_prob = attention_dropout
    config.hidden_dropout_prob = 0.0
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    bert_cluster.convert(model, clusters=4, topk=8, min_length=0, backend="reference")
    return model


def _batch(rows=3, width=50):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 60, (rows, width), generator=generator)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[1, 40:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(rows) % 2}


def test_a_converted_model_drops_attention_in_train_and_not_in_eval(caplog):
    model = _model(0.3)
    without = copy.deepcopy(model)
    without.config.attention_probs_dropout_prob = 0.0
    for layer in without.bert.encoder.layer:
        layer.attention.self.dropout.p = 0.0
    batch = _batch()
    model.train()
    with caplog.at_level(logging.WARNING):
        torch.manual_seed(0)
        first = model(**batch).logits
    torch.manual_seed(0)
    same = model(**batch).logits
    second = model(**batch).logits
    assert torch.equal(first, same) and not torch.equal(first, second)
    assert "dropout" not in caplog.text  # the old "applies no attention dropout" warning is gone
    without.train()
    assert not torch.equal(first, without(**batch).logits)
    model.eval(), without.eval()
    with torch.inference_mode():
        assert torch.equal(model(**batch).logits, without(**batch).logits)


def test_gradient_checkpointing_with_dropout_gives_the_same_gradients():
    model = _model(0.3).train()
    batch = _batch()

    def gradients():
        model.zero_grad()
        torch.manual_seed(7)
        model(**batch).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = gradients()
    for name, grad in plain.items():
        assert torch.equal(checkpointed[name], grad), name


@pytest.mark.slow(reason="torch.compile of a training step (inductor compiles C++ on first use)")
def test_a_compiled_step_with_dropout_gives_the_eager_gradients():
    config = _config("i-clustered+")
    q, k, v, valid = _inputs(n=50)

    def loss(q_, k_, v_):
        return clustered_attention(q_, k_, v_, valid, config, dropout=0.2).square().sum()

    results = []
    # fallback_random: the compiled graph draws the call's dropout seed as eager does (inductor's own
    # random numbers differ from eager's by design); the backward must then use the forward's masks.
    with torch._inductor.config.patch(fallback_random=True):
        for step in (loss, torch.compile(loss, fullgraph=True)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(13)
            value = step(*leaves)
            value.backward()
            results.append((value, [t.grad for t in leaves]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    # The attention output is the same bits; the compiled sum of its squares adds in another order.
    torch.testing.assert_close(eager_loss, compiled_loss, rtol=1e-6, atol=0)
    plain = clustered_attention(q, k, v, valid, config).square().sum()
    assert not torch.equal(eager_loss, plain)  # the masks did drop weights
    for eager, compiled in zip(eager_grads, compiled_grads, strict=True):
        assert torch.equal(eager, compiled)


# --- the dropout ops: CPU kernels (kernels/cpu/dropout.cpp) against the reference -----------------------

#: tests/ops/test_ops.py's measured tolerances for an op's float outputs (both sides compute in fp32 from
#: the same inputs; the dtype only changes the input values) and tests/ops/test_backward.py's for the input
#: gradients (relative to the largest entry of each; bf16: one bf16 ulp after the final rounding).
OP_ATOL = {"fp32": 4e-6, "bf16": 6e-6}
OP_RTOL = 2e-6
GRAD_RTOL = {"fp32": 4e-6, "bf16": 8e-3}
P = 0.3


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    clusters: int
    topk: int
    dk: int
    dv: int
    dtype: str
    padded: bool
    window: int = 3

    def __str__(self) -> str:
        pad = "-pad" if self.padded else ""
        return (
            f"N{self.n}-C{self.clusters}-k{self.topk}-D{self.dk}x{self.dv}-w{self.window}-{self.dtype}{pad}"
        )


# The property suite's layouts (tests/ops/test_backward.py's GRID): N = 1, C > valid N, odd head dims,
# Dv != Dk, k > N, padding on both sides, fp32 and bf16, and windows below, at and above N.
GRID = [
    Case(1, 1, 1, 8, 8, "fp32", False, window=0),
    Case(7, 25, 4, 5, 7, "fp32", True, window=2),
    Case(31, 4, 8, 16, 16, "bf16", True),
    Case(31, 4, 40, 16, 24, "fp32", True, window=40),
    Case(200, 10, 16, 32, 32, "fp32", True, window=7),
    Case(200, 10, 16, 32, 32, "bf16", False),
    Case(300, 25, 91, 32, 16, "fp32", True, window=20),
]


def _case_inputs(case: Case, seed: int = 0):
    """q, k, v, valid and the reference's discrete choices (assignments, centroids, top-k) for both modes."""
    generator = torch.Generator().manual_seed(seed)
    rows, heads = 2, 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
    q, k = (torch.randn(rows, heads, case.n, case.dk, generator=generator).to(dtype) for _ in range(2))
    v = torch.randn(rows, heads, case.n, case.dv, generator=generator).to(dtype)
    valid = torch.ones(rows, case.n, dtype=torch.bool)
    if case.padded and case.n > 2:
        valid[1, case.n - case.n // 3 :] = False
        valid[1, 0] = False
    scaling = 1 / case.dk**0.5
    planes, offsets = hash_planes(0, 0, 32, case.dk)
    hashes = reference.hash_queries(q, planes, offsets)
    assignments, _ = reference.hamming_kmeans(hashes, valid, case.clusters, 10, 32)
    plus, centroids, _ = reference.lloyd_refine(q, assignments, case.clusters, 2)
    _, indices, mass, _ = reference.centroid_attention(centroids, k, v, valid, case.topk, scaling)
    return q, k, v, valid, scaling, plus, centroids, indices, mass


def _op_calls(case: Case, dropout: float = P, seed: int = 17):
    """Per op that drops: (its differentiable inputs, a function of them taking the step to call)."""
    q, k, v, valid, scaling, plus, centroids, indices, mass = _case_inputs(case)
    rest = reference.centroid_rest(centroids, k, v, valid, indices, scaling, dropout, seed)
    nothing = torch.zeros_like(rest)
    drop = (dropout, seed)
    return {
        "centroid_rest": (
            {"centroids": centroids, "keys": k, "values": v},
            lambda step, centroids, keys, values: step(
                centroids, keys, values, valid, indices, scaling, *drop
            ),
        ),
        "topk_refine": (
            {"queries": q, "keys": k, "values": v, "vc": rest, "mass": mass, "topv": nothing},
            lambda step, queries, keys, values, vc, mass, topv: step(
                queries, keys, values, plus, vc, indices, mass, topv, scaling, *drop
            ),
        ),
        "refine_with_query_mass": (
            {"queries": q, "keys": k, "values": v, "c": centroids, "vc": rest, "mass": mass, "topv": nothing},
            lambda step, queries, keys, values, c, vc, mass, topv: step(
                queries, keys, values, valid, plus, c, vc, indices, mass, topv, scaling, *drop
            ),
        ),
        "banded_attention": (
            {"queries": q, "keys": k, "values": v},
            lambda step, queries, keys, values: step(
                queries, keys, values, valid, case.window, scaling, *drop
            ),
        ),
    }


DROPOUT_OPS = [
    "centroid_rest",
    "topk_refine",
    "refine_with_query_mass",
    "banded_attention",
]


def _forward_and_grads(step, call, inputs: dict, output_grad=None):
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    out = call(step, **leaves)
    if output_grad is None:
        output_grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, list(leaves.values()), output_grad)
    return out.detach(), dict(zip(leaves, grads, strict=True)), output_grad


@pytest.mark.parametrize("op", DROPOUT_OPS)
@pytest.mark.parametrize("case", GRID, ids=str)
def test_dropout_kernels_match_the_reference_forward_and_backward(case, op):
    require_kernels("cpu")
    inputs, call = _op_calls(case)[op]
    expected, expected_grads, output_grad = _forward_and_grads(getattr(reference, op), call, inputs)
    got, got_grads, _ = _forward_and_grads(getattr(dispatch.CpuKernelBackend, op), call, inputs, output_grad)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=OP_ATOL[case.dtype], rtol=OP_RTOL)
    for name, want in expected_grads.items():
        have = got_grads[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.isfinite(have).all(), name
        scale = max(want.float().abs().max().item(), 1e-6)
        error = (have.float() - want.float()).abs().max().item() / scale
        assert error <= GRAD_RTOL[case.dtype], f"{op} d{name}: relative error {error:.3g}"


@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_dropout_kernels_give_the_same_bits_twice_at_any_thread_count(op):
    require_kernels("cpu")
    case = Case(200, 10, 16, 32, 24, "fp32", True, window=9)
    inputs, call = _op_calls(case)[op]
    step = getattr(dispatch.CpuKernelBackend, op)
    first = _forward_and_grads(step, call, inputs)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            again = _forward_and_grads(step, call, inputs, first[2])
            assert torch.equal(again[0], first[0])
            for name, grad in first[1].items():
                assert torch.equal(again[1][name], grad), name
    finally:
        torch.set_num_threads(threads)


def _identity_values(rows: int, heads: int, n: int) -> torch.Tensor:
    return torch.eye(n).expand(rows, heads, n, n).contiguous()


@pytest.mark.parametrize("dropout", [0.1, 0.5, 0.9])
def test_dropout_kernels_draw_the_references_masks(dropout):
    """With one-hot values each output element is one weight: the kept ones are exactly the reference's."""
    require_kernels("cpu")
    case = Case(120, 6, 10, 16, 120, "fp32", True, window=130)
    q, k, _, valid, scaling, plus, centroids, indices, mass = _case_inputs(case)
    v = _identity_values(2, 2, case.n)
    kernels = dispatch.CpuKernelBackend
    for seed in (0, 5, 2**61 + 3):
        rest = (
            reference.centroid_rest(centroids, k, v, valid, indices, scaling, dropout, seed),
            kernels.centroid_rest(centroids, k, v, valid, indices, scaling, dropout, seed),
        )
        nothing = torch.zeros_like(rest[0])
        pairs = {
            "centroid_rest": rest,
            "topk_refine": tuple(
                step(q, k, v, plus, nothing, indices, mass, nothing, scaling, dropout, seed)
                for step in (reference.topk_refine, kernels.topk_refine)
            ),
            "banded_attention": tuple(
                step(q, k, v, valid, case.window, scaling, dropout, seed)
                for step in (reference.banded_attention, kernels.banded_attention)
            ),
        }
        undropped = {
            "centroid_rest": reference.centroid_rest(centroids, k, v, valid, indices, scaling),
            "topk_refine": reference.topk_refine(q, k, v, plus, nothing, indices, mass, nothing, scaling),
            "banded_attention": reference.banded_attention(q, k, v, valid, case.window, scaling),
        }
        for name, (expected, got) in pairs.items():
            weighed = undropped[name] != 0
            assert torch.equal(got[weighed] != 0, expected[weighed] != 0), name
            share = (expected[weighed] == 0).float().mean().item()
            assert abs(share - dropout) < 0.05, (name, share)


def test_dropout_zero_gives_the_plain_ops():
    """Dropout 0 is the ops without dropout, bit for bit (whatever the seed); the centroids' rest is the
    centroid attention's Vc - Vtop."""
    require_kernels("cpu")
    case = Case(200, 10, 16, 32, 24, "fp32", True, window=9)
    q, k, v, valid, scaling, plus, centroids, indices, mass = _case_inputs(case)
    kernels = dispatch.CpuKernelBackend
    vc, chosen, _, topv = kernels.centroid_attention(centroids, k, v, valid, case.topk, scaling)
    assert torch.equal(chosen, indices)  # the same inputs chose the same top-k
    close = {"atol": OP_ATOL["fp32"], "rtol": OP_RTOL}
    rest = kernels.centroid_rest(centroids, k, v, valid, indices, scaling, 0.0, 5)
    torch.testing.assert_close(rest, vc - topv, **close)
    assert torch.equal(
        kernels.topk_refine(q, k, v, plus, vc, indices, mass, topv, scaling, 0.0, 5),
        kernels.topk_refine(q, k, v, plus, vc, indices, mass, topv, scaling),
    )
    own = (q, k, v, valid, plus, centroids, vc, indices, mass, topv, scaling)
    assert torch.equal(kernels.refine_with_query_mass(*own, 0.0, 5), kernels.refine_with_query_mass(*own))
    assert torch.equal(
        kernels.banded_attention(q, k, v, valid, 9, scaling, 0.0, 5),
        kernels.banded_attention(q, k, v, valid, 9, scaling),
    )
    dropped = kernels.topk_refine(q, k, v, plus, vc, indices, mass, topv, scaling, P, 5)
    assert not torch.equal(dropped, kernels.topk_refine(q, k, v, plus, vc, indices, mass, topv, scaling))


@pytest.mark.slow(reason="gradcheck in float64 of every dropout op: one forward per input element")
def test_dropout_ops_pass_gradcheck_in_float64_on_the_reference():
    """No kernel takes float64: gradcheck runs on the reference functions the kernels are checked against."""
    case = Case(12, 3, 4, 4, 4, "fp32", True, window=2)
    for op, (inputs, call) in _op_calls(case).items():
        names = list(inputs)
        leaves = tuple(t.double().requires_grad_() for t in inputs.values())
        step = getattr(reference, op)

        def function(*tensors, step=step, call=call, names=names):
            return call(step, **dict(zip(names, tensors, strict=True)))

        assert torch.autograd.gradcheck(function, leaves), op


def _opcheck_cases():
    case = Case(40, 5, 8, 16, 16, "fp32", True, window=3)
    q, k, v, valid, scaling, plus, centroids, indices, mass = _case_inputs(case)

    def grad(t):
        return t.clone().requires_grad_()

    rest = reference.centroid_rest(centroids, k, v, valid, indices, scaling, P, 4)
    zero = torch.zeros_like(rest)
    g_out = torch.randn(2, 2, case.n, case.dv)
    return {
        "centroid_rest": (grad(centroids), grad(k), grad(v), valid, indices, scaling, P, 4),
        "topk_refine": (
            grad(q), grad(k), grad(v), plus, grad(rest), indices, grad(mass), grad(zero), scaling, P, 4,
        ),
        "refine_with_query_mass": (
            grad(q), grad(k), grad(v), valid, plus, grad(centroids), grad(rest), indices, grad(mass),
            grad(zero), scaling, P, 4,
        ),
        "banded_attention": (grad(q), grad(k), grad(v), valid, 3, scaling, P, 4),
        "centroid_rest_backward": (torch.randn(rest.shape), centroids, k, v, valid, indices, scaling, P, 4),
        "topk_refine_backward": (g_out, q, k, v, plus, indices, mass, scaling, P, 4),
        "refine_with_query_mass_backward": (
            g_out, q, k, v, valid, plus, centroids, rest, indices, mass, zero, scaling, P, 4,
        ),
        "banded_attention_backward": (g_out, q, k, v, valid, 3, scaling, P, 4),
    }  # fmt: skip


@pytest.mark.parametrize("op", list(_opcheck_cases()))
def test_opcheck_the_dropout_ops(op):
    dispatch.CpuKernelBackend.is_available()  # loads _C (its CPU kernels) where it is built
    tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if op.endswith("_backward"):
        tests = ["test_schema", "test_faketensor"]
    torch.library.opcheck(getattr(torch.ops.bert_cluster, op).default, _opcheck_cases()[op], test_utils=tests)


@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_dropout_kernels_ignore_what_padding_holds(op):
    """NaN in padded queries, keys and values changes no output or gradient bit (never multiplied by 0)."""
    require_kernels("cpu")
    case = Case(70, 6, 8, 16, 24, "fp32", True, window=5)
    inputs, call = _op_calls(case)[op]
    padded = ~_case_inputs(case)[3][:, None, :, None]  # (R, 1, N, 1)
    poisoned = {
        name: torch.where(padded, math.nan, t) if name in ("queries", "keys", "values") else t
        for name, t in inputs.items()
    }
    step = getattr(dispatch.CpuKernelBackend, op)
    clean = _forward_and_grads(step, call, inputs)
    dirty = _forward_and_grads(step, call, poisoned, clean[2])
    assert torch.equal(dirty[0], clean[0])
    for name, grad in clean[1].items():
        assert torch.equal(dirty[1][name], grad), name


def test_windowed_attention_drops_on_the_cpu_kernels_like_the_reference():
    require_kernels("cpu")
    q, k, v, valid = _inputs(rows=2, heads=2, n=60, dim=16, seed=4)
    results = []
    for name in ("reference", "cpu"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(6)
        out = windowed_attention(*leaves, valid, 5, ClusteredAttentionConfig(backend=name), dropout=0.3)
        out.square().sum().backward()
        results.append((out, [t.grad for t in leaves]))
    (ref_out, ref_grads), (out, grads) = results
    plain = windowed_attention(q, k, v, valid, 5, ClusteredAttentionConfig(backend="cpu"))
    assert not torch.equal(out, plain)
    torch.testing.assert_close(out, ref_out, atol=OP_ATOL["fp32"], rtol=OP_RTOL)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        scale = ref_grad.abs().max().item()
        assert (grad - ref_grad).abs().max().item() <= GRAD_RTOL["fp32"] * scale
