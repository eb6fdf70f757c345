"""Layer indices of a reloaded checkpoint come from the model's structure (issue 11 item 3).

DistilBERT, GTE, nomic-bert and Jina v3 attention modules carry no ``layer_idx``; a reloaded checkpoint
must still give each module the index ``convert`` gave it (which selects its hash planes and ``layers=``),
whatever the garbage collector reuses and however many threads make the first calls.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from families import tiny_model

import bert_cluster


def batch():
    torch.manual_seed(3)
    ids = torch.randint(5, 100, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    return ids, mask


def forward(model, ids, mask):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.fixture(scope="module")
def saved_distilbert(tmp_path_factory):
    """A DistilBERT patched on its second layer only, saved; and what it computes."""
    model = tiny_model("distilbert")
    bert_cluster.convert(model, clusters=2, topk=2, layers=[1], min_length=0)
    ids, mask = batch()
    expected = forward(model, ids, mask)
    path = tmp_path_factory.mktemp("distilbert") / "model"
    model.save_pretrained(path)
    return path, expected


def test_two_hundred_reloads_keep_the_layer_indices(saved_distilbert):
    # Before the fix, indices were counted per id(config): a reloaded config that reused a collected one's
    # id continued its count, so layers got indices 2, 3, ... (6 of 200 reloads in the report).
    from transformers import AutoModel
    from transformers.utils import logging

    path, expected = saved_distilbert
    ids, mask = batch()
    wrong = []
    logging.disable_progress_bar()  # 200 progress bars cost more than the reloads
    gc.freeze()  # the objects alive now are never collected: gc.collect() takes ms instead of 0.4 s
    try:
        for attempt in range(200):
            model = AutoModel.from_pretrained(path).eval()
            if not torch.equal(forward(model, ids, mask), expected):
                wrong.append(attempt)
            del model
            gc.collect()
    finally:
        gc.unfreeze()
        logging.enable_progress_bar()
    assert wrong == []


def test_first_calls_from_four_threads_agree(saved_distilbert):
    # Before the fix, concurrent first calls raced on one counter (2 of 40 wrong in the report).
    from transformers import AutoModel

    path, expected = saved_distilbert
    ids, mask = batch()
    wrong = []
    for _ in range(10):
        model = AutoModel.from_pretrained(path).eval()
        start = threading.Barrier(4)

        def first_call(model=model, start=start):
            start.wait()
            out = forward(model, ids, mask)
            if not torch.equal(out, expected):
                wrong.append(out)

        threads = [threading.Thread(target=first_call) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(wrong) == 0, f"{len(wrong)} of 40 first calls computed other layers"


@pytest.mark.parametrize("family", ["nomic_bert", "gte", "jina_embeddings_v3"])
def test_reloaded_families_without_layer_idx_get_their_converted_indices(family, tmp_path):
    # GTE and Jina v3 run eagerly; nomic-bert's first call is a compiled one (dynamo runs the lookup eagerly).
    from transformers import AutoModel

    model = bert_cluster.convert(tiny_model(family), clusters=2, topk=2, layers=[1], min_length=0)
    ids, mask = batch()
    expected = forward(model, ids, mask)
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    if family == "nomic_bert":
        reloaded = torch.compile(reloaded, backend="aot_eager")
    with torch.inference_mode():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, expected)
    modules = bert_cluster.hf.attention_modules(getattr(reloaded, "_orig_mod", reloaded))
    assert [module._bert_cluster_layer for module in modules] == [0, 1]


def test_an_attention_module_called_outside_its_model_says_so():
    model = bert_cluster.convert(tiny_model("distilbert"), clusters=2, min_length=0)
    module = bert_cluster.hf.attention_modules(model)[0]
    del module._bert_cluster_layer  # as after a reload, before the first call
    query = torch.randn(1, 4, 8, 8)
    with pytest.raises(RuntimeError, match="cannot tell which layer this DistilBertSelfAttention is"):
        bert_cluster.hf.attention_forward(module, query, query, query, None)
