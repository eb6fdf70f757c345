"""Training a converted model (issue 38): gradients through the kernels, optimiser steps, the ecosystem's
tools (HF Trainer, gradient checkpointing, torch.compile of a step, bf16 autocast, DDP on gloo).

Tiny random BERTs with attention dropout off (its masks differ between the exact and the converted
model: tests/test_dropout.py tests it), so that the two compute comparable things.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from helpers import tiny_bert_config

import bert_cluster
from bert_cluster import dispatch


def _kernels_or_skip() -> None:
    ok, why = dispatch.CpuKernelBackend.is_available()
    if not ok:
        pytest.skip(f"CPU kernels unavailable: {why}")


def _model(seed: int = 0):
    from transformers import BertForSequenceClassification

    config = tiny_bert_config(num_labels=2)
    config.attention_probs_dropout_prob = 0.0
    config.hidden_dropout_prob = 0.0
    torch.manual_seed(seed)
    return BertForSequenceClassification(config).train()


def _batch(rows: int = 4, width: int = 60, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (rows, width), generator=generator)
    mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(1, rows):  # rows of several lengths, all longer than C
        mask[row, width - 7 * row :] = 0
        ids[row, width - 7 * row :] = 0
    labels = torch.arange(rows) % 2
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["i-clustered+", "i-clustered"])
def test_with_topk_at_least_n_the_converted_model_has_the_exact_models_gradients(mode):
    _kernels_or_skip()
    exact = _model()
    converted = copy.deepcopy(exact)
    bert_cluster.convert(converted, clusters=4, topk=64, mode=mode, min_length=0, backend="cpu")
    batch = _batch()
    expected, got = _gradients(exact, batch), _gradients(converted, batch)
    assert expected.keys() == got.keys() and len(got) > 20
    for name, grad in expected.items():
        assert torch.isfinite(got[name]).all(), name
        # Measured max abs difference 4.8e-7 (fp32 sums in other orders), gradients up to 0.88 -> 1e-5.
        assert (got[name] - grad).abs().max().item() <= 1e-5 * max(1.0, grad.abs().max().item()), name


def test_optimiser_steps_lower_the_loss_like_the_exact_models():
    _kernels_or_skip()
    batch = _batch(rows=6, width=80)
    losses = {}
    for name in ("exact", "converted"):
        model = _model(seed=2)
        if name == "converted":
            bert_cluster.convert(model, clusters=4, topk=8, min_length=0, backend="cpu")
        optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(12):
            optimiser.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimiser.step()
            curve.append(loss.item())
        losses[name] = curve
    exact, converted = losses["exact"], losses["converted"]
    assert all(torch.isfinite(torch.tensor(converted)))
    # Measured (12 AdamW steps on one batch): exact 0.915 -> 0.012, converted (C = 4, k = 8 of 80 tokens)
    # 0.958 -> 0.016; the two starts differ by 0.043 (the approximation at initialisation).
    assert converted[-1] < 0.1 * converted[0]
    assert converted[-1] <= 2 * exact[-1] + 0.01
    assert abs(converted[0] - exact[0]) < 0.1


def test_gradient_checkpointing_gives_the_same_gradients():
    _kernels_or_skip()
    model = _model()
    bert_cluster.convert(model, clusters=4, topk=8, min_length=0, backend="cpu")
    batch = _batch()
    plain = _gradients(model, batch)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _gradients(model, batch)
    for name, grad in plain.items():
        assert torch.equal(checkpointed[name], grad), name  # the same forward twice: the same bits


def test_a_compiled_training_step_gives_the_eager_gradients():
    _kernels_or_skip()
    from bert_cluster import ClusteredAttentionConfig, clustered_attention

    config = ClusteredAttentionConfig(clusters=4, topk=8, min_length=0, backend="cpu")
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 2, 50, 16, generator=generator) for _ in range(3)]

    def loss(q, k, v):
        return clustered_attention(q, k, v, None, config).square().sum()

    grads = []
    for step in (loss, torch.compile(loss, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        step(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads, strict=True):
        assert torch.equal(eager, compiled)


def test_bf16_autocast_trains():
    _kernels_or_skip()
    model = _model()
    bert_cluster.convert(model, clusters=4, topk=8, min_length=0, backend="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**_batch()).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert all(g.dtype == torch.float32 for g in grads)  # the weights stay fp32 under autocast


def test_trained_model_saves_and_reloads_patched(tmp_path):
    _kernels_or_skip()
    from transformers import AutoModelForSequenceClassification

    model = _model()
    bert_cluster.convert(model, clusters=4, topk=8, min_length=0, backend="cpu")
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**_batch()).loss.backward()
    optimiser.step()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    model.eval()
    assert reloaded.config.clustered_attention == model.config.clustered_attention
    batch = {k: v for k, v in _batch().items() if k != "labels"}
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits)


def test_hf_trainer_runs_a_converted_model(tmp_path):
    _kernels_or_skip()
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    batch = _batch(rows=8, width=60)
    rows = [{key: value[i] for key, value in batch.items()} for i in range(8)]
    dataset = Dataset.from_list([{k: v.tolist() for k, v in row.items()} for row in rows])
    model = _model()
    bert_cluster.convert(model, clusters=4, topk=8, min_length=0)
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=6,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


_DDP_TIMEOUT_S = 120  # one run takes about 15 s on 2 Zen 4 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    # Gloo on loopback, every wait bounded, and the DDP model freed while the group is whole: seen in CI
    # and reproduced with the host name resolving to another interface, a rank hung on its way out
    # (tearing down the model's reducer after its peer had gone), and gloo's default wait is 30 minutes.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=_DDP_TIMEOUT_S)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        weights = _ddp_train(rank, world)
        if rank == 0:
            torch.save(weights, out)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _ddp_train(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = torch.nn.parallel.DistributedDataParallel(_converted_model())
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = _batch(rows=4, width=60)
    share = {k: v[rank::world] for k, v in batch.items()}
    for _ in range(3):
        optimiser.zero_grad()
        model(**share).loss.backward()
        optimiser.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _converted_model():
    model = _model(seed=4)
    bert_cluster.convert(model, clusters=4, topk=8, min_length=0, backend="cpu")
    return model


@pytest.mark.slow
def test_ddp_on_two_processes_matches_one_process(tmp_path):
    _kernels_or_skip()
    out = str(tmp_path / "ddp.pt")
    workers = mp.start_processes(_ddp_worker, args=(2, _free_port(), out), nprocs=2, join=False)
    deadline = time.monotonic() + 3 * _DDP_TIMEOUT_S
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"the two DDP workers did not finish within {3 * _DDP_TIMEOUT_S} s")
    ddp_weights = torch.load(out)
    # One process, the whole batch: DDP averages the two halves' gradients, which equals the gradient of
    # the mean loss over the batch when the halves have equal size (the classification loss is a mean).
    model = _converted_model()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = _batch(rows=4, width=60)
    halves = [{k: v[rank::2] for k, v in batch.items()} for rank in range(2)]
    for _ in range(3):
        optimiser.zero_grad()
        loss = sum(model(**half).loss for half in halves) / 2
        loss.backward()
        optimiser.step()
    # Measured max abs difference of the weights after 3 steps 6e-8 (the all-reduce's summation order).
    for name, weight in model.state_dict().items():
        assert (ddp_weights[name] - weight).abs().max().item() <= 1e-6, name
