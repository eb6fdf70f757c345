"""Long-document retrieval (kind ``long-retrieval``): SQuAD v1.1 dev articles as documents.

Clustered attention pays with thousands of tokens, not at BERT's 512. This kind embeds each of the 48
SQuAD v1.1 dev articles as one document (its paragraphs joined: 2,937 to 17,512 tokens with MiniLM's
tokenizer, median 6,594), embeds every question, and scores the question's article among all documents
by cosine similarity (sentence-transformers' ``InformationRetrievalEvaluator``: recall@k, MRR@k, ...).
Documents are truncated at ``--max-length`` (default: as many tokens as the model's positions take) and
encoded like the other embedding kinds' texts (``SentenceTransformer.encode``: the checkpoint's own
pooling and normalisation, mean pooling for a plain transformers folder), in the runner's timed batches.

With ``options.long_position_proxy: N`` the task scores an *untrained* proxy of the model whose position
table is copied to N rows (``bert_cluster.tasks.proxy``); every report says so.

Trained (``finetune``, loss ``contrastive`` or ``contrastive-bank``; ``configs/tasks/long/
squad_articles_train.yaml``): a step embeds ``batch_size`` articles, no article twice, and
``options.questions_per_article`` (16) questions of each, so that one article embedding, the costly part
of a step, trains 16 questions instead of one (with one, the loss was 0.002 within a few steps and the
held-out score never moved). Each question is scored against the step's articles (in-batch negatives;
at one question per article this is sentence-transformers' MultipleNegativesRankingLoss), and with
``contrastive-bank`` also against the other training articles' last embeddings. Through
sentence-transformers' own Trainer (its batch sampler with no duplicates, its checkpoints).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bert_cluster.checkpoints import load_sentence_encoder, max_positions, resolve_model
from bert_cluster.datafiles import PARAGRAPH_SEPARATOR, join_paragraphs
from bert_cluster.errors import UserError, one_line
from bert_cluster.tasks.data import load_rows
from bert_cluster.tasks.kinds import (
    Examples,
    LoadedModel,
    Locator,
    Progress,
    ScoreSettings,
    TrainingModel,
    check_each_row,
    check_metrics,
    check_text,
    positive_option,
    register_kind,
)
from bert_cluster.tasks.kinds.embedding import (
    RETRIEVAL_METRIC,
    RetrievalSet,
    _EmbeddingKind,
    _two_text_fields,
    retrieval_scores,
    spread,
    transformer_of,
)

#: Task options this kind reads (see ``configs/tasks/long/squad_articles.yaml``).
OPTIONS = ("documents", "questions", "document_batch_size", "long_position_proxy", "questions_per_article")
#: Articles are cut at this many characters per token of the training length before tokenising (a
#: WordPiece token of English text averages about 4 characters): the tokenizer would otherwise encode each
#: whole article, up to 17.5k tokens, to keep the first 4,096, which made up a third of a short run.
CHARACTERS_PER_TOKEN = 12
#: The loss's scale of the cosine similarities (sentence-transformers' MultipleNegativesRankingLoss's).
SCALE = 20.0


# --------------------------------------------------------------------------------------------------
# Articles: the corpus rebuilt from paragraphs
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Articles:
    """Documents (one per article, in source order) and questions with the index of their article."""

    titles: list[str]
    documents: list[str]
    questions: list[str]
    gold: list[int]
    question_ids: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.question_ids:
            self.question_ids = [str(number) for number in range(len(self.questions))]
        if len(self.titles) != len(self.documents) or not (
            len(self.questions) == len(self.gold) == len(self.question_ids)
        ):
            raise ValueError("titles/documents and questions/gold/question ids must pair up")
        if len(set(self.titles)) != len(self.titles) or len(set(self.question_ids)) != len(self.question_ids):
            raise ValueError("titles and question ids must be distinct")
        if any(not 0 <= index < len(self.documents) for index in self.gold):
            raise ValueError(f"gold article indices must be in 0..{len(self.documents) - 1}")

    def as_retrieval(self) -> RetrievalSet:
        """The same corpus as the retrieval kind scores it (articles are the passages, titles their ids)."""
        return RetrievalSet(
            passage_ids=self.titles,
            passages=self.documents,
            question_ids=self.question_ids,
            questions=self.questions,
            gold=self.gold,
        )


def articles_from_paragraphs(
    paragraphs: Iterable[Mapping[str, str]], questions: Iterable[Mapping[str, str]]
) -> Articles:
    """Join paragraphs into articles and map each question to its article.

    Args:
        paragraphs: ``{id, context}`` with ids ``"<article title>/<paragraph number from 0>"`` (the
            packaged ``squad_v1_dev_retrieval.json.gz``); an article's paragraphs must be numbered 0..n-1.
        questions: ``{question, paragraph}`` (and ``id``), ``paragraph`` the id of the paragraph it was
            asked on.

    Raises:
        ValueError: a malformed or duplicated paragraph id, a gap in the numbering, or a question whose
            paragraph is unknown.
    """
    by_title = join_paragraphs(paragraphs)
    titles = list(by_title)
    documents = [PARAGRAPH_SEPARATOR.join(by_title[title]) for title in titles]
    index = {title: position for position, title in enumerate(titles)}
    texts, gold, ids = [], [], []
    for number, question in enumerate(questions):
        title, _, paragraph = str(question["paragraph"]).rpartition("/")
        if title not in index or not paragraph.isdigit() or int(paragraph) >= len(by_title[title]):
            raise ValueError(
                f"question {question.get('id', '')!r}: unknown paragraph {question['paragraph']!r}"
            )
        texts.append(question["question"])
        gold.append(index[title])
        ids.append(str(question.get("id") or number))
    return Articles(titles, documents, texts, gold, ids)


def articles_from_rows(rows: Iterable[Mapping[str, Any]], question: str, context: str) -> Articles:
    """Articles from flat SQuAD rows (``title``, the question and context fields; ``passage_id`` if any).

    Every reader of ``bert_cluster.tasks.data`` gives such rows: the official SQuAD JSON, the packaged
    retrieval file (whose rows carry ``passage_id`` = ``<title>/<n>``) and the hub's ``rajpurkar/squad``.
    Without a ``passage_id``, a title's paragraphs are numbered in order of first appearance.
    """
    numbers: dict[tuple[str, str], str] = {}
    per_title: dict[str, int] = {}
    paragraphs, questions = [], []
    for number, row in enumerate(rows):
        title = str(row.get("title") or "")
        key = (title, row[context])
        if key not in numbers:
            numbers[key] = row.get("passage_id") or f"{title}/{per_title.get(title, 0)}"
            per_title[title] = per_title.get(title, 0) + 1
            paragraphs.append({"id": numbers[key], "context": row[context]})
        questions.append(
            {"id": str(row.get("id") or number), "question": row[question], "paragraph": numbers[key]}
        )
    return articles_from_paragraphs(paragraphs, questions)


def select(
    articles: Articles, documents: int | None = None, questions: int | None = None, limit: int | None = None
) -> Articles:
    """A deterministic sample of articles and questions.

    ``documents`` articles spread evenly over the set, then ``questions`` (and at most ``limit``) of their
    questions spread evenly; the corpus keeps only the articles those questions ask about.

    ``select(articles, limit=1057)`` is every 10th of SQuAD's 10,570 questions, over all 48 articles.
    """
    kept_articles = spread(len(articles.documents), documents)
    renumber = {old: new for new, old in enumerate(kept_articles)}
    pairs = [
        (qid, text, renumber[gold])
        for qid, text, gold in zip(articles.question_ids, articles.questions, articles.gold, strict=True)
        if gold in renumber
    ]
    count = min(n for n in (questions, limit, len(pairs)) if n is not None)
    pairs = [pairs[i] for i in spread(len(pairs), count)]
    asked = sorted({gold for _, _, gold in pairs})
    final = {old: new for new, old in enumerate(asked)}
    return Articles(
        titles=[articles.titles[kept_articles[i]] for i in asked],
        documents=[articles.documents[kept_articles[i]] for i in asked],
        questions=[text for _, text, _ in pairs],
        gold=[final[gold] for _, _, gold in pairs],
        question_ids=[qid for qid, _, _ in pairs],
    )


# --------------------------------------------------------------------------------------------------
# The kind
# --------------------------------------------------------------------------------------------------


def task_options(task: Any) -> dict[str, Any]:
    """The task's options, validated, with their defaults.

    Raises:
        UserError: an unknown option or a value that is not a positive int.
    """
    unknown = sorted(set(task.options) - set(OPTIONS))
    if unknown:
        raise UserError(
            f"task {task.name}: unknown option(s) {unknown} for kind {task.kind}; allowed: {sorted(OPTIONS)}"
        )
    defaults = {"document_batch_size": 1, "questions_per_article": 16}
    return {
        key: positive_option(task, f"options.{key}", task.options.get(key), defaults.get(key))
        for key in OPTIONS
    }


def cut_articles(
    rows: Iterable[Mapping[str, Any]], task: Any, max_length: int, what: str = "training"
) -> Articles:
    """The articles of a split's rows, each cut at ``max_length`` tokens' worth of characters.

    ``CHARACTERS_PER_TOKEN`` per token, as training cuts them (before tokenising).

    Raises:
        UserError: the rows do not rebuild into articles.
    """
    try:
        articles = articles_from_rows(rows, *task.text_fields)
    except (KeyError, ValueError) as error:
        raise UserError(f"task {task.name}: cannot rebuild the {what} articles ({one_line(error)})") from None
    cut = [document[: CHARACTERS_PER_TOKEN * max_length] for document in articles.documents]
    return dataclasses.replace(articles, documents=cut)


def split_articles(
    task: Any, split: str, max_length: int, data_dir: Sequence[str | Path] | None = None
) -> Articles:
    """A split's articles, cut as training cuts them: the recipe's data as a benchmark reads it.

    ``split``: ``train`` (what ``finetune`` trains on) or ``dev`` (the held-out split it scores).

    Raises:
        UserError: the split's rows are missing or do not rebuild into articles.
    """
    what = "training" if split == "train" else "held-out"
    return cut_articles(load_rows(task, data_dir, split=split).rows, task, max_length, what)


def proxy_label(positions: int) -> str:
    """How every report names the untrained long-position proxy."""
    return f"an UNTRAINED proxy with positions copied to {positions:,} (p mod its original table)"


def article_rows(pairs: Sequence[tuple[str, str]], questions_per_article: int, seed: int) -> dict[str, Any]:
    """Training rows of ``questions_per_article`` questions of one article and the article.

    Articles interleaved in a seeded order: one article's embedding (the costly part of a step) then
    serves that many questions instead of one. An article's last row is filled from its own shuffled
    questions again. Returns the columns (``question_0``.., ``article``, ``label``: the article's index)
    and the ``documents`` in index order.
    """
    by_article: dict[str, list[str]] = {}
    for question, document in pairs:
        by_article.setdefault(document, []).append(question)
    documents = list(by_article)
    generator = random.Random(seed)
    rows: list[tuple[list[str], str, int]] = []
    for index, document in enumerate(documents):
        questions = by_article[document][:]
        generator.shuffle(questions)
        for start in range(0, len(questions), questions_per_article):
            chunk = questions[start : start + questions_per_article]
            chunk += questions[: questions_per_article - len(chunk)]
            rows.append((chunk, document, index))
    generator.shuffle(rows)
    columns: dict[str, list[Any]] = {
        f"question_{j}": [row[0][j] for row in rows] for j in range(questions_per_article)
    }
    columns["article"] = [row[1] for row in rows]
    columns["label"] = [row[2] for row in rows]
    return {"columns": columns, "documents": documents}


def article_retrieval_loss(model: Any, documents: Sequence[str], bank: bool, scale: float = SCALE) -> Any:
    """Each question against the batch's articles, and with ``bank`` against every training article.

    In-batch negatives with sentence-transformers' scaled cosine and cross-entropy; the bank holds the
    last embedding of every other training article (no gradient through those): the held-out task is a
    choice among 24 articles, while 3 in-batch negatives gave a loss of 0.08 from the first step and
    little to learn from.
    """
    import torch
    from torch.nn.functional import cross_entropy, normalize

    class ArticleRetrievalLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.bank: torch.Tensor | None = None

        def _fill_bank(self) -> torch.Tensor:
            """The training articles' embeddings before the first step (counted as training time)."""
            with torch.no_grad():
                rows = [self.embed(self.model.preprocess([document])) for document in documents]
            return torch.cat(rows).detach()

        def embed(self, features: Any) -> torch.Tensor:
            return normalize(self.model(features)["sentence_embedding"].float(), dim=-1)

        def forward(self, sentence_features: Any, labels: torch.Tensor) -> torch.Tensor:
            *question_columns, article_column = list(sentence_features)
            articles = self.embed(article_column)
            questions = torch.cat([self.embed(column) for column in question_columns])
            targets = torch.arange(len(articles)).repeat(len(question_columns))
            candidates = articles
            if bank:
                if self.bank is None:
                    self.bank = self._fill_bank()
                others = torch.ones(len(self.bank), dtype=torch.bool)
                others[labels] = False
                candidates = torch.cat([articles, self.bank[others]])
                self.bank[labels] = articles.detach()
            return cross_entropy(scale * questions @ candidates.T, targets)

    return ArticleRetrievalLoss()


class LongRetrievalKind(_EmbeddingKind):
    """Article retrieval over whole documents: one embedding per article, questions as queries."""

    name = "long-retrieval"
    losses = ("contrastive", "contrastive-bank")
    lora = False  # every weight (as the recipe was measured); LoRA's peft does not wrap a SentenceTransformer
    distillable = False

    def check(self, task: Any) -> None:
        """Two text fields (question, context), known positive-int options, retrieval metric names."""
        _two_text_fields(task)
        task_options(task)
        check_metrics(
            task, RETRIEVAL_METRIC.fullmatch, "accuracy@k, precision@k, recall@k, mrr@k, ndcg@k, map@k"
        )

    def positions(self, task: Any, checkpoint_positions: int | None) -> int | None:
        """The positions of the model this task scores: the proxy's when it builds one."""
        return task_options(task)["long_position_proxy"] or checkpoint_positions

    def load_model(self, model: str | Path, task: Any, device: str) -> LoadedModel:
        """A SentenceTransformer whose default truncation is the model's whole position table.

        With ``options.long_position_proxy: N`` the model is an untrained proxy of ``model`` (a local
        checkpoint folder or ``package:NAME``) with its positions copied to N, built once into the cache.
        """
        from bert_cluster.tasks.proxy import long_position_proxy

        positions = task_options(task)["long_position_proxy"]
        notes = {}
        if positions is not None:
            source = Path(resolve_model(model))
            if not source.is_dir():
                raise UserError(
                    f"task {task.name} builds a long-position proxy of a local checkpoint folder, got {model}"
                )
            try:
                model = long_position_proxy(source, positions)
            except (ValueError, OSError) as error:
                raise UserError(f"task {task.name}: {one_line(error)}") from None
            notes["model"] = proxy_label(positions)
        loaded = super().load_model(model, task, device)
        loaded.extra["own_max_length"] = loaded.max_positions or loaded.extra["own_max_length"]
        loaded.extra["notes"] = {**notes, **loaded.extra["notes"]}
        return loaded

    def load_examples(self, task: Any, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """The articles and questions, sampled by the task's ``documents``/``questions`` and ``limit``."""
        positive_option(task, "limit", limit)
        options = task_options(task)
        rows = load_rows(task, data_dir)
        try:
            articles = articles_from_rows(rows.rows, *task.text_fields)
        except (KeyError, ValueError) as error:
            raise UserError(f"{rows.source}: cannot rebuild the articles ({one_line(error)})") from None
        articles = select(articles, options["documents"], options["questions"], limit)
        described = (
            f"{rows.source} ({len(articles.documents)} articles as documents, "
            f"{len(articles.questions)} questions"
        )
        if options["long_position_proxy"] is not None:
            described += f"; model: {proxy_label(options['long_position_proxy'])}"
        return Examples(
            items=articles,
            source=described + ")",
            count=len(articles.questions),
            notes={"corpus": len(articles.documents)},
        )

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """The task's metrics (x 100) of each question's article, and what was measured on the way.

        Besides the metrics: ``max_length`` (the truncation used), ``document_tokens`` (tokens embedded)
        and ``documents_time_s`` / ``queries_time_s`` (this process's model time for each part, after the
        runner's warm-up batch: the documents are where attention costs).
        """
        articles: Articles = examples.items
        documents, questions = len(articles.documents), len(articles.questions)
        per_document = dataclasses.replace(settings, batch_size=task_options(task)["document_batch_size"])
        timing = settings.workers.timing
        began = timing.seconds
        vectors = self._embed(
            loaded,
            task,
            per_document,
            articles.documents,
            lambda done, total, *tokens: advance(done, total + questions, *tokens),
        )
        documents_time = timing.seconds - began
        vectors.update(
            self._embed(
                loaded,
                task,
                settings,
                articles.questions,
                lambda done, total, *tokens: advance(documents + done, documents + total, *tokens),
            )
        )
        encoder = loaded.model
        lengths = encoder.tokenizer(articles.documents, truncation=True, max_length=encoder.max_seq_length)
        return {
            **retrieval_scores(vectors, articles.as_retrieval(), task.metric_names),
            "max_length": float(encoder.max_seq_length),
            "document_tokens": float(sum(map(len, lengths["input_ids"]))),
            "documents_time_s": documents_time,
            "queries_time_s": timing.seconds - began - documents_time,
        }

    # ---------------------------------------------------------------------------------- training

    def check_training(self, task: Any) -> None:
        """Nothing beyond ``check``: the articles are the labels."""

    def training_model(
        self, source: str, task: Any, overrides: Mapping[str, Any] | None = None
    ) -> TrainingModel:
        """A ``SentenceTransformer`` (a plain transformers folder gets mean pooling).

        ``overrides``: model config settings (the attention dropout) to load it with.
        """
        encoder, path = load_sentence_encoder(source, "cpu", overrides)
        return TrainingModel(encoder, encoder.tokenizer, path, patched=transformer_of(encoder))

    def scoring_model(self, trained: TrainingModel) -> LoadedModel:
        """The model in training as ``score`` takes it (the held-out split at the marks)."""
        return LoadedModel(
            model=trained.model,
            tokenizer=trained.tokenizer,
            patched=trained.target,
            max_positions=max_positions(trained.target.config),
            extra={"own_max_length": trained.model.max_seq_length, "notes": {}},
        )

    def check_rows(self, rows: Sequence[dict[str, Any]], task: Any, where: Locator) -> None:
        """A question and its context (a paragraph of the article) in every row."""

        def check(row: dict[str, Any]) -> None:
            for field in task.text_fields:
                check_text(row.get(field), field)

        check_each_row(rows, where, check)

    def training_features(self, rows: Sequence[dict[str, Any]], task: Any, trained: TrainingModel) -> Any:
        """Rows of ``questions_per_article`` questions and their article (cut before tokenising)."""
        from datasets import Dataset

        max_length = trained.max_length
        articles = cut_articles(rows, task, max_length)
        pairs = [
            (question, articles.documents[gold])
            for question, gold in zip(articles.questions, articles.gold, strict=True)
        ]
        made = article_rows(pairs, task_options(task)["questions_per_article"], trained.seed)
        trained.model.max_seq_length = max_length
        trained.extra["documents"] = made["documents"]
        trained.extra["bank"] = task.train.loss == "contrastive-bank"
        return Dataset.from_dict(made["columns"])

    def trainer(self, trained: TrainingModel, features: Any, setup: dict[str, Any]) -> Any:
        """sentence-transformers' Trainer: no article twice in a batch, the task's contrastive loss."""
        from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers

        class Trainer(SentenceTransformerTrainer):
            def add_model_card_callback(self, *args: Any, **kwargs: Any) -> None:
                """No model card: its dataset statistics tokenise every article again (half a short run)."""

        return Trainer(
            model=trained.model,
            args=SentenceTransformerTrainingArguments(
                **setup["arguments"], batch_sampler=BatchSamplers.NO_DUPLICATES
            ),
            train_dataset=features,
            loss=article_retrieval_loss(
                trained.model, trained.extra["documents"], bank=trained.extra["bank"]
            ),
            callbacks=setup["callbacks"],
        )

    def save(self, model: Any, tokenizer: Any, output: Path) -> None:
        """The SentenceTransformer folder (its modules, pooling included), which ``evaluate`` loads."""
        model.save(str(output))


LONG_RETRIEVAL = register_kind(LongRetrievalKind())
