"""The sentence-embedding kinds: encoding through sentence-transformers, its evaluators, the packaged data."""

from __future__ import annotations

import csv
import gzip
import hashlib
import math
from pathlib import Path

import helpers
import pytest
import torch

import bert_cluster
from bert_cluster.datafiles import PACKAGE_DATA
from bert_cluster.errors import UserError
from bert_cluster.tasks.config import get_tasks, load_tasks
from bert_cluster.tasks.data import load_rows
from bert_cluster.tasks.kinds import KINDS, ScoreSettings, get_kind
from bert_cluster.tasks.kinds import embedding as E

REPO = Path(__file__).resolve().parents[2]
SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog near the river bank on a sunny afternoon.",
    "Hi.",
    " ".join(["Clustered attention groups queries that are close to each other."] * 4),
]


# --- metrics through sentence-transformers' evaluators, on hand-made embeddings --------------------------


def _hand_case() -> tuple[dict[str, torch.Tensor], E.RetrievalSet]:
    """Four passages on the plane and five questions whose gold ranks follow from the geometry.

    Passages: p0 = east, p1 = north, p2 = north-east, p3 = west (norms differ: ranking is by cosine).
    - q0 = (1, 0.1), gold p0: nearest                                         -> rank 1
    - q1 = (0.2, 1), gold p0: north and north-east are nearer                 -> rank 3
    - q2 = (1, 1), gold p3: west is the farthest                              -> rank 4
    - q3 = (0.9, 1), gold p2: north-east is nearest                           -> rank 1
    - q4 = (1, 1), gold p0: p2 scores higher, p1 ties with p0 exactly; the evaluator breaks ties by
      passage id, ascending, so p0 comes before p1                            -> rank 2
    """
    passages = {"p0": [2.0, 0.0], "p1": [0.0, 0.5], "p2": [3.0, 3.0], "p3": [-1.0, 0.0]}
    questions = {"q0": [1.0, 0.1], "q1": [0.2, 1.0], "q2": [1.0, 1.0], "q3": [0.9, 1.0], "q4": [4.0, 4.0]}
    texts = {f"text {key}": torch.tensor(value) for key, value in {**passages, **questions}.items()}
    data = E.RetrievalSet(
        passage_ids=list(passages),
        passages=[f"text {key}" for key in passages],
        question_ids=list(questions),
        questions=[f"text {key}" for key in questions],
        gold=[0, 0, 3, 2, 0],
    )
    return texts, data


def test_retrieval_metrics_on_a_hand_made_case():
    vectors, data = _hand_case()
    ranks = [1, 3, 4, 1, 2]
    scores = E.retrieval_scores(vectors, data, ["recall@1", "recall@3", "accuracy@5", "mrr@10", "mrr@3"])
    assert scores["recall@1"] == pytest.approx(100 * 2 / 5)
    assert scores["recall@3"] == pytest.approx(100 * 4 / 5)
    assert scores["accuracy@5"] == pytest.approx(100.0)
    assert scores["mrr@10"] == pytest.approx(100 * sum(1 / r for r in ranks) / 5)
    # Beyond the cut-off a reciprocal rank counts 0: rank 4 drops out of MRR@3.
    assert scores["mrr@3"] == pytest.approx(100 * sum(1 / r for r in ranks if r <= 3) / 5)


def test_sts_correlations_by_hand():
    # Angles 0, 30, 60 and 90 degrees from (1, 0): cosines 1, 0.866, 0.5, 0, in the order of the gold scores.
    angles = [0.0, math.pi / 6, math.pi / 3, math.pi / 2]
    vectors = {"east": torch.tensor([1.0, 0.0])}
    vectors.update({f"a{i}": torch.tensor([math.cos(a), math.sin(a)]) for i, a in enumerate(angles)})
    gold = [5.0, 3.0, 2.0, 0.0]
    pairs = E.StsPairs(["east"] * 4, [f"a{i}" for i in range(4)], gold)
    scores = E.sts_scores(vectors, pairs, ["spearman", "pearson"])
    assert scores["spearman"] == pytest.approx(100.0)
    cosines = [math.cos(a) for a in angles]
    mean_c, mean_g = sum(cosines) / 4, sum(gold) / 4
    covariance = sum((c - mean_c) * (g - mean_g) for c, g in zip(cosines, gold, strict=True))
    spread_c = math.sqrt(sum((c - mean_c) ** 2 for c in cosines))
    spread_g = math.sqrt(sum((g - mean_g) ** 2 for g in gold))
    assert scores["pearson"] == pytest.approx(100 * covariance / (spread_c * spread_g))


def test_metric_names_are_checked_against_the_kind():
    import dataclasses

    task = load_tasks()["squad-retrieval"]
    for metrics, message in (
        (("recal@1",), r"unknown metric\(s\) \['recal@1'\]"),
        (("recall@0",), "unknown metric"),
        ((), "no metrics"),
    ):
        from bert_cluster.tasks.config import MetricSpec

        bad = dataclasses.replace(task, metrics=tuple(MetricSpec(m, m) for m in metrics))
        with pytest.raises(UserError, match=message):
            get_kind(bad)
    with pytest.raises(UserError, match="unknown option"):
        get_kind(dataclasses.replace(task, options={"recall_at": [1]}))
    for documents in (0, -2, 1.5, True, "8"):
        with pytest.raises(UserError, match="options.documents must be a positive int"):
            get_kind(dataclasses.replace(task, options={"documents": documents}))


# --- encoding through SentenceTransformer.encode --------------------------------------------------------


def _kind_embeddings(folder: Path, texts: list[str], batch_size: int = 2) -> torch.Tensor:
    task = get_tasks("stsb-embedding")[0]
    loaded = E.STS_EMBEDDING.load_model(folder, task, "cpu")
    vectors = E.STS_EMBEDDING._embed(
        loaded, task, ScoreSettings(batch_size=batch_size), texts, lambda *progress: None
    )
    return torch.stack([vectors[text] for text in texts])


@pytest.mark.parametrize(
    ("pooling", "dense", "normalize"),
    [
        ("mean", None, True),
        ("cls", 24, False),
        ("max", 16, True),
        ("mean_sqrt_len_tokens", None, False),
        ("weightedmean", None, False),
        ("lasttoken", None, False),
        (("cls", "mean"), 8, True),
    ],
)
def test_every_module_comes_from_sentence_transformers(tmp_path, pooling, dense, normalize):
    """The kind's embeddings are SentenceTransformer.encode's: every pooling mode, Dense, Normalize."""
    from sentence_transformers import SentenceTransformer

    folder = helpers.save_sentence_transformer(
        tmp_path / "st", pooling=pooling, dense=dense, normalize=normalize
    )
    reference = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    ours = _kind_embeddings(folder, SENTENCES)
    modes = (pooling,) if isinstance(pooling, str) else pooling
    assert ours.shape == reference.shape and ours.shape[1] == (dense or 32 * len(modes))
    # Measured: at most 1.9e-6 apart over these 7 cases (same model and maths; other batch composition).
    assert (ours - reference.cpu()).abs().max() < 1e-5
    if normalize:
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


@pytest.fixture(scope="module")
def tiny_st(tmp_path_factory) -> Path:
    return helpers.save_sentence_transformer(tmp_path_factory.mktemp("st") / "st", max_seq_length=128)


def test_a_converted_sentence_transformer_against_the_unconverted_one(tiny_st):
    """Exact when top-k >= N, approximate when it is not, and revert gives back the same bits."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(tiny_st), device="cpu")
    target = E.transformer_of(encoder)
    before = encoder.encode(SENTENCES, convert_to_tensor=True)
    bert_cluster.convert(target, clusters=2, topk=512, min_length=0)
    exact = encoder.encode(SENTENCES, convert_to_tensor=True)
    # Measured: 8.9e-8 (top-k over every key is exact attention; the sums run in another order).
    assert (exact - before).abs().max() < 1e-5
    bert_cluster.revert(target)
    bert_cluster.convert(target, clusters=2, topk=2, min_length=0)
    approximate = encoder.encode(SENTENCES, convert_to_tensor=True)
    # The longest sentence (128 tokens after truncation), 2 clusters, 2 exact keys each: measured 0.027.
    assert (approximate - before).abs().max() > 1e-3
    bert_cluster.revert(target)
    assert torch.equal(encoder.encode(SENTENCES, convert_to_tensor=True), before)


def test_kinds_are_registered_and_load_a_sentence_transformer(tiny_st):
    assert KINDS["sts-embedding"] is E.STS_EMBEDDING and KINDS["retrieval"] is E.RETRIEVAL
    loaded = E.RETRIEVAL.load_model(tiny_st, get_tasks("squad-retrieval")[0], "cpu")
    assert type(loaded.model).__name__ == "SentenceTransformer"
    assert loaded.target is E.transformer_of(loaded.model) and type(loaded.target).__name__ == "BertModel"
    assert loaded.extra["notes"]["encoder"] == "Transformer > Pooling > Normalize"


def test_a_plain_transformers_folder_gets_mean_pooling(tmp_path):
    folder = helpers.save_model(tmp_path / "plain", head="base", labels=None)
    loaded = E.STS_EMBEDDING.load_model(folder, get_tasks("stsb-embedding")[0], "cpu")
    assert loaded.extra["notes"]["encoder"] == "Transformer > Pooling"


# --- data ----------------------------------------------------------------------------------------------


def test_packaged_data_is_complete():
    tasks = load_tasks()
    pairs = E.STS_EMBEDDING.load_examples(tasks["stsb-embedding"], None, None)
    assert pairs.count == 1500 and pairs.source.endswith("stsb_dev.tsv.gz")
    assert all(0.0 <= score <= 5.0 for score in pairs.items.gold)
    assert pairs.items.first[0] == "A man with a hard hat is dancing."
    retrieval = E.RETRIEVAL.load_examples(tasks["squad-retrieval"], None, None)
    data = retrieval.items
    assert len(data.passages) == len(set(data.passage_ids)) == retrieval.notes["corpus"] == 2067
    assert len(data.questions) == len(data.gold) == retrieval.count == 10570
    assert set(data.gold) == set(range(2067))  # every paragraph has questions; several share one
    assert (PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz").stat().st_size < 1_200_000


def test_packaged_data_carries_licences():
    readme = (PACKAGE_DATA / "README.md").read_text(encoding="utf-8")
    assert "CC BY-SA 4.0" in readme and "sha256" in readme.lower()
    # GLUE's STS-B LICENSE.txt, byte for byte (sha256 as published in ../shared/data/README.md).
    licence = (PACKAGE_DATA / "STS-B-LICENSE.txt").read_bytes()
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


def test_a_retrieval_limit_shrinks_the_corpus_and_keeps_the_gold_passages():
    task = load_tasks()["squad-retrieval"]
    full = E.RETRIEVAL.load_examples(task, None, None).items
    examples = E.RETRIEVAL.load_examples(task, None, 50)
    data = examples.items
    assert examples.count == len(data.questions) == 50
    # 50 of 10,570 questions: their gold passages (fewer: some share one) plus ceil(2067 * 50 / 10570) = 10.
    golds = {full.passage_ids[full.gold[i]] for i in E.spread(10570, 50)}
    assert golds <= set(data.passage_ids) and len(data.passages) <= len(golds) + 10 < 100
    assert examples.notes["corpus"] == len(data.passages)
    for question, gold in zip(
        data.questions, data.gold, strict=True
    ):  # gold indices point into the new corpus
        original = full.questions.index(question)
        assert data.passages[gold] == full.passages[full.gold[original]]


def test_the_retrieval_sample_keeps_whole_articles_spread_over_the_set():
    """squad-retrieval-sample: every twelfth of the 48 articles, with all their questions and paragraphs."""
    tasks = load_tasks()
    full = E.RETRIEVAL.load_examples(tasks["squad-retrieval"], None, None).items
    sample = E.RETRIEVAL.load_examples(tasks["squad-retrieval-sample"], None, None)
    data = sample.items

    def title(passage_id: str) -> str:
        return passage_id.rpartition("/")[0]

    titles = list(dict.fromkeys(title(p) for p in full.passage_ids))
    assert len(titles) == 48 and tasks["squad-retrieval-sample"].options == {"documents": 4}
    kept = [titles[i] for i in range(0, 48, 12)]
    assert list(dict.fromkeys(title(p) for p in data.passage_ids)) == kept
    # All of those articles' paragraphs and questions, each question still pointing at its own paragraph.
    assert data.passage_ids == [p for p in full.passage_ids if title(p) in kept]
    asked = [i for i, gold in enumerate(full.gold) if title(full.passage_ids[gold]) in kept]
    assert data.question_ids == [full.question_ids[i] for i in asked]
    assert [data.passage_ids[g] for g in data.gold] == [full.passage_ids[full.gold[i]] for i in asked]
    assert sample.count == len(asked) == 1692 and sample.notes["corpus"] == 242
    # Half of the articles the embedded default's long-document sample reads as whole documents.
    from bert_cluster.tasks.kinds import long_retrieval as L

    rows = load_rows(tasks["squad-articles"], None).rows
    assert L.select(L.articles_from_rows(rows, "question", "context"), 8).titles[::2] == kept
    # A limit then samples the sample's questions.
    limited = E.RETRIEVAL.load_examples(tasks["squad-retrieval-sample"], None, 100)
    assert limited.count == 100 and set(limited.items.question_ids) <= set(data.question_ids)
    # More documents than articles: the whole set, unchanged.
    assert E.of_articles(full, 100) is full and E.of_articles(full, None) is full


@pytest.mark.data
def test_shared_files_give_the_packaged_examples(shared_dir):
    """Reading the original files from --data-dir gives exactly the packaged examples (ids and golds)."""
    tasks = load_tasks()
    sts_shared = E.STS_EMBEDDING.load_examples(tasks["stsb-embedding"], [shared_dir / "data"], None)
    sts_packaged = E.STS_EMBEDDING.load_examples(tasks["stsb-embedding"], None, None)
    assert sts_shared.source.endswith("STS-B/dev.tsv")
    assert sts_shared.items == sts_packaged.items
    squad_shared = E.RETRIEVAL.load_examples(tasks["squad-retrieval"], [shared_dir / "data"], None)
    squad_packaged = E.RETRIEVAL.load_examples(tasks["squad-retrieval"], None, None)
    assert squad_shared.source.endswith("dev-v1.1.json")
    assert squad_shared.items == squad_packaged.items


@pytest.mark.data
def test_make_demo_data_reproduces_the_shipped_files(shared_dir, tmp_path):
    from benchmarks import make_demo_data

    assert make_demo_data.main(["--shared", str(shared_dir / "data"), "--check"]) == 0
    # A fresh build into a temporary folder is byte-identical to the shipped one (no timestamps).
    assert make_demo_data.main(["--shared", str(shared_dir / "data"), "--out", str(tmp_path)]) == 0
    for name in ("stsb_dev.tsv.gz", "squad_v1_dev_retrieval.json.gz", "STS-B-LICENSE.txt"):
        assert (tmp_path / name).read_bytes() == (PACKAGE_DATA / name).read_bytes()
    with open(shared_dir / "data/glue/STS-B/dev.tsv", encoding="utf-8", newline="") as handle:
        source = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    with gzip.open(tmp_path / "stsb_dev.tsv.gz", "rt", encoding="utf-8", newline="") as handle:
        shipped = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert [(r["sentence1"], r["sentence2"], r["score"]) for r in shipped] == [
        (r["sentence1"], r["sentence2"], r["score"]) for r in source
    ]
    assert load_rows(load_tasks()["stsb-embedding"], None).rows[0]["sentence1"] == shipped[0]["sentence1"]
