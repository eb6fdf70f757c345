"""Long-document retrieval: SQuAD v1.1 dev articles as documents, their questions as queries.

Clustered attention pays with thousands of tokens, not at BERT's 512. This kind (``long-retrieval``)
embeds each of the 48 SQuAD v1.1 dev articles as one document (its paragraphs joined: 2,937 to 17,512
tokens with MiniLM's tokenizer, median 6,594), embeds every question, and scores recall@k and MRR@n of
the question's article among all documents by cosine similarity. Documents are truncated at
``--max-length`` (default: the most tokens the model's position table takes). Encoding and pooling go
through sentence-transformers (``SentenceTransformer.encode`` with the checkpoint's own modules).

The embedded default runs the task on an untrained *long-position proxy* (``long_position_proxy``):
a short-context checkpoint whose learned position table is copied to more positions, position p taking
row p mod P (Longformer's initialisation). It measures how far an attention approximation moves a real
model's outputs on long text, not what a trained long-context model would score.

Importing this module registers the kind (the runner imports it). It depends on nothing else of the
evaluation package but the kind protocol and ``UserError``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.kinds import Examples, LoadedModel, Progress, ScoreSettings, register_kind

#: The kind's name in task files.
KIND = "long-retrieval"
#: Paragraphs of one article are joined with a blank line (whitespace: it adds no token).
PARAGRAPH_SEPARATOR = "\n\n"
#: Task options this kind reads (see ``configs/tasks/long/squad_articles.yaml``).
OPTIONS = {
    "packaged",
    "documents",
    "questions",
    "document_batch_size",
    "recall_at",
    "mrr_at",
    "long_position_proxy",
}
#: Where a built proxy is cached: this variable, else ``$XDG_CACHE_HOME/bert-cluster``, else ``~/.cache``.
CACHE_ENV = "BERT_CLUSTER_CACHE"
#: Files of a checkpoint that hold weights (a proxy rewrites them; everything else is copied).
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
#: Bump when the proxy files change, so caches built by an older version are not reused.
_PROXY_FORMAT = 1


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

    def __post_init__(self) -> None:
        if len(self.titles) != len(self.documents) or len(self.questions) != len(self.gold):
            raise ValueError("titles/documents and questions/gold must pair up")
        if any(not 0 <= index < len(self.documents) for index in self.gold):
            raise ValueError(f"gold article indices must be in 0..{len(self.documents) - 1}")


def articles_from_paragraphs(
    paragraphs: Iterable[Mapping[str, str]], questions: Iterable[Mapping[str, str]]
) -> Articles:
    """Join paragraphs into articles and map each question to its article.

    Args:
        paragraphs: ``{id, context}`` with ids ``"<article title>/<paragraph number from 0>"`` (the
            packaged ``squad_v1_dev_retrieval.json.gz``); an article's paragraphs must be numbered 0..n-1.
        questions: ``{question, paragraph}``, ``paragraph`` the id of the paragraph it was asked on.

    Raises:
        ValueError: a malformed or duplicated paragraph id, a gap in the numbering, or a question whose
            paragraph is unknown.
    """
    by_title: dict[str, dict[int, str]] = {}
    for paragraph in paragraphs:
        title, _, number = str(paragraph["id"]).rpartition("/")
        if not title or not number.isdigit():
            raise ValueError(f"paragraph id {paragraph['id']!r} is not '<title>/<number>'")
        numbered = by_title.setdefault(title, {})
        if int(number) in numbered:
            raise ValueError(f"paragraph id {paragraph['id']!r} appears twice")
        numbered[int(number)] = paragraph["context"]
    titles = list(by_title)
    documents = []
    for title in titles:
        numbers = sorted(by_title[title])
        if numbers != list(range(len(numbers))):
            raise ValueError(f"article {title!r}: paragraphs must be numbered 0..n-1, got {numbers}")
        documents.append(PARAGRAPH_SEPARATOR.join(by_title[title][n] for n in numbers))
    index = {title: position for position, title in enumerate(titles)}
    texts, gold = [], []
    for question in questions:
        title, _, number = str(question["paragraph"]).rpartition("/")
        if title not in index or not number.isdigit() or int(number) not in by_title[title]:
            raise ValueError(
                f"question {question.get('id', '')!r}: unknown paragraph {question['paragraph']!r}"
            )
        texts.append(question["question"])
        gold.append(index[title])
    return Articles(titles, documents, texts, gold)


def articles_from_squad(document: Mapping[str, Any]) -> Articles:
    """Articles from the official SQuAD JSON (``{"data": [{title, paragraphs: [{context, qas}]}]}``)."""
    paragraphs, questions = [], []
    for article in document["data"]:
        for number, paragraph in enumerate(article["paragraphs"]):
            paragraph_id = f"{article['title']}/{number}"
            paragraphs.append({"id": paragraph_id, "context": paragraph["context"]})
            questions += [
                {"id": qa["id"], "question": qa["question"], "paragraph": paragraph_id}
                for qa in paragraph["qas"]
            ]
    return articles_from_paragraphs(paragraphs, questions)


def articles_from_rows(rows: Iterable[Mapping[str, Any]]) -> Articles:
    """Articles from flat SQuAD rows (``title, context, question``; the hub's ``rajpurkar/squad``)."""
    numbers: dict[tuple[str, str], str] = {}
    per_title: dict[str, int] = {}
    paragraphs, questions = [], []
    for row in rows:
        key = (str(row["title"]), row["context"])
        if key not in numbers:
            numbers[key] = f"{key[0]}/{per_title.get(key[0], 0)}"
            per_title[key[0]] = per_title.get(key[0], 0) + 1
            paragraphs.append({"id": numbers[key], "context": row["context"]})
        questions.append({"id": row.get("id", ""), "question": row["question"], "paragraph": numbers[key]})
    return articles_from_paragraphs(paragraphs, questions)


def read_packaged(path: Path) -> Articles:
    """The packaged SQuAD file (``paragraphs`` [{id, context}], ``questions`` [{id, question, paragraph}])."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        document = json.load(handle)
    return articles_from_paragraphs(document["paragraphs"], document["questions"])


def spread(count: int, keep: int | None) -> list[int]:
    """``keep`` indices spread evenly over ``range(count)`` (all of them when ``keep`` is None or larger)."""
    if keep is None or keep >= count:
        return list(range(count))
    return [math.floor(i * count / keep) for i in range(keep)]


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
        (q, renumber[g]) for q, g in zip(articles.questions, articles.gold, strict=True) if g in renumber
    ]
    count = min(n for n in (questions, limit, len(pairs)) if n is not None)
    pairs = [pairs[i] for i in spread(len(pairs), count)]
    asked = sorted({gold for _, gold in pairs})
    final = {old: new for new, old in enumerate(asked)}
    return Articles(
        titles=[articles.titles[kept_articles[i]] for i in asked],
        documents=[articles.documents[kept_articles[i]] for i in asked],
        questions=[question for question, _ in pairs],
        gold=[final[gold] for _, gold in pairs],
    )


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def gold_ranks(queries: torch.Tensor, documents: torch.Tensor, gold: Sequence[int]) -> torch.Tensor:
    """Rank (1 = best) of each query's gold document by cosine similarity.

    Ties count against the query (the rank is how many documents score at least as high as the gold
    one), so a collapsed model that embeds everything alike gets the worst rank, not the best.
    """
    if queries.dim() != 2 or documents.dim() != 2 or queries.shape[1] != documents.shape[1]:
        raise ValueError(
            f"queries (Q, D) and documents (N, D) must share D, got {queries.shape}, {documents.shape}"
        )
    gold = torch.as_tensor(gold, dtype=torch.long)
    if gold.shape != (queries.shape[0],) or (
        len(gold) and not 0 <= int(gold.min()) <= int(gold.max()) < len(documents)
    ):
        raise ValueError(f"need one gold index in 0..{len(documents) - 1} per query")
    similarity = (
        torch.nn.functional.normalize(queries.float(), dim=-1)
        @ torch.nn.functional.normalize(documents.float(), dim=-1).T
    )
    return (similarity >= similarity.gather(1, gold[:, None])).sum(1)


def retrieval_metrics(
    ranks: torch.Tensor, recall_at: Sequence[int] = (1, 5), mrr_at: int = 10
) -> dict[str, float]:
    """Recall@k and MRR@``mrr_at`` x 100 from gold ranks (a reciprocal rank beyond ``mrr_at`` counts 0)."""
    if len(ranks) == 0:
        raise ValueError("no queries to score")
    ranks = torch.as_tensor(ranks, dtype=torch.float64)
    metrics = {f"recall@{k}": 100.0 * float((ranks <= k).double().mean()) for k in recall_at}
    metrics[f"mrr@{mrr_at}"] = 100.0 * float(torch.where(ranks <= mrr_at, 1.0 / ranks, 0.0).mean())
    return metrics


# --------------------------------------------------------------------------------------------------
# The long-position proxy
# --------------------------------------------------------------------------------------------------


def position_offset(config: Mapping[str, Any]) -> int:
    """Rows of the position table before position 0: RoBERTa-style models start at ``pad_token_id + 1``."""
    model_type = str(config.get("model_type", ""))
    if model_type in ("roberta", "xlm-roberta", "camembert", "data2vec-text", "xlm-roberta-xl"):
        return int(config.get("pad_token_id", 1)) + 1
    return 0


def model_max_positions(config: Any) -> int | None:
    """The most tokens a model's position table takes (``max_position_embeddings`` less any offset)."""
    values = config if isinstance(config, Mapping) else config.to_dict()
    positions = values.get("max_position_embeddings")
    if not isinstance(positions, int) or positions <= 0:
        return None
    return positions - position_offset(values)


def cache_dir() -> Path:
    """Where proxies are built: ``$BERT_CLUSTER_CACHE``, the user cache folder, or a temp folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bert-cluster"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"bert-cluster-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _digest(folder: Path) -> str:
    """A hash of a checkpoint's config and weights (a changed source gets a new proxy)."""
    digest = hashlib.sha256()
    for name in ("config.json", *_WEIGHT_FILES):
        path = folder / name
        if path.is_file():
            digest.update(name.encode())
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def long_position_proxy(model: str | Path, positions: int, cache: str | Path | None = None) -> Path:
    """An untrained long-context proxy of a checkpoint with learned absolute positions (built once, cached).

    The position table of ``model`` (P rows) is copied to ``positions`` rows, position p taking row
    p mod P, with no further training; every other weight and file (tokenizer, sentence-transformers
    modules) is kept, and ``max_seq_length`` / ``model_max_length`` become ``positions``. On inputs of at
    most P tokens the proxy computes exactly what the original does.

    Args:
        model: a local checkpoint folder with ``config.json`` and ``model.safetensors``.
        positions: the tokens the proxy takes (position 0 onwards), more than the original's P.
        cache: where to build it (default ``cache_dir()``); the folder name carries a hash of the source.

    Returns:
        The proxy's folder, with ``bert_cluster_proxy.json`` recording how it was made.

    Raises:
        ValueError: ``positions`` not above P, a model without a learned absolute position table, or
            weights not in a single ``model.safetensors``.
    """
    from safetensors.torch import load_file, save_file

    source = Path(model).expanduser().resolve()
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be a positive int, got {positions!r}")
    config_path, weights_path = source / "config.json", source / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{source}: a long-position proxy needs config.json and a single model.safetensors")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{source}: position_embedding_type {config['position_embedding_type']!r}; a long-position proxy "
            "copies a learned absolute position table"
        )
    original = model_max_positions(config)
    if original is None:
        raise ValueError(f"{source}: config.json has no max_position_embeddings to extend")
    if positions <= original:
        raise ValueError(
            f"{source} already takes {original} positions; a proxy must have more (asked for {positions})"
        )
    offset = position_offset(config)
    folder = Path(cache) if cache is not None else cache_dir()
    target = folder / f"{source.name}-positions-{positions}-{_digest(source)}-v{_PROXY_FORMAT}"
    if (target / "bert_cluster_proxy.json").is_file():
        return target

    state = load_file(str(weights_path))
    keys = [key for key in state if key.endswith("embeddings.position_embeddings.weight")]
    if len(keys) != 1 or state[keys[0]].shape[0] != original + offset:
        raise ValueError(
            f"{source}: expected one learned position table of {original + offset} rows "
            f"(*embeddings.position_embeddings.weight), found {keys}"
        )
    table = state[keys[0]]
    rows = torch.arange(positions) % original + offset
    state[keys[0]] = torch.cat([table[:offset], table[rows]]).contiguous()
    for key in [key for key in state if key.endswith("embeddings.position_ids")]:  # older checkpoints keep it
        state[key] = torch.arange(positions + offset, dtype=state[key].dtype)[None]

    folder.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=folder))
    try:
        shutil.copytree(source, building, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*_WEIGHT_FILES))
        save_file(state, str(building / "model.safetensors"), metadata={"format": "pt"})
        config["max_position_embeddings"] = positions + offset
        (building / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, key in (
            ("sentence_bert_config.json", "max_seq_length"),
            ("tokenizer_config.json", "model_max_length"),
        ):
            path = building / name
            if path.is_file():
                settings = json.loads(path.read_text(encoding="utf-8"))
                settings[key] = positions
                path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        record = {
            "format": _PROXY_FORMAT,
            "source": str(source),
            "source_positions": original,
            "positions": positions,
            "rule": f"position p takes the source's position row (p mod {original})",
            "trained": False,
            "note": "an untrained long-context proxy: for measuring attention approximations on long text",
        }
        (building / "bert_cluster_proxy.json").write_text(
            json.dumps(record, indent=2) + "\n", encoding="utf-8"
        )
        try:
            building.rename(target)
        except OSError:  # built meanwhile by another process: keep that one
            if not (target / "bert_cluster_proxy.json").is_file():
                raise
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------------
# The kind
# --------------------------------------------------------------------------------------------------


def _positive(task: Any, key: str, value: Any, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"task {task.name}: {key} must be a positive int, got {value!r}")
    return value


def _options(task: Any) -> dict[str, Any]:
    """The task's options, validated, with their defaults."""
    unknown = sorted(set(task.options) - OPTIONS)
    if unknown:
        raise UserError(
            f"task {task.name}: unknown option(s) {unknown} for kind {KIND}; allowed: {sorted(OPTIONS)}"
        )
    options = dict(task.options)
    recall_at = options.get("recall_at", [1, 5])
    if not isinstance(recall_at, (list, tuple)) or not recall_at:
        raise UserError(
            f"task {task.name}: options.recall_at must be a non-empty list of ints, got {recall_at!r}"
        )
    return {
        "packaged": options.get("packaged"),
        "documents": _positive(task, "options.documents", options.get("documents")),
        "questions": _positive(task, "options.questions", options.get("questions")),
        "document_batch_size": _positive(
            task, "options.document_batch_size", options.get("document_batch_size", 1), False
        ),
        "recall_at": tuple(_positive(task, "options.recall_at", k, False) for k in recall_at),
        "mrr_at": _positive(task, "options.mrr_at", options.get("mrr_at", 10), False),
        "long_position_proxy": _positive(
            task, "options.long_position_proxy", options.get("long_position_proxy")
        ),
    }


def _find_local(task: Any, data_dir: Any) -> Path | None:
    """The first of the task's local files in the data folders (or one level below them)."""
    folders = [] if data_dir is None else [data_dir] if isinstance(data_dir, (str, Path)) else list(data_dir)
    folders += [part for part in os.environ.get("BERT_CLUSTER_DATA_DIR", "").split(os.pathsep) if part]
    for folder in map(Path, folders):
        for spec in task.data.files:
            if spec.format != "squad-json":
                raise UserError(f"task {task.name}: kind {KIND} reads squad-json files, not {spec.format}")
            for candidate in (folder / spec.path, *sorted(folder.glob(f"*/{spec.path}"))):
                if candidate.is_file():
                    return candidate
    return None


def load_articles(task: Any, data_dir: Any = None) -> tuple[Articles, str]:
    """All articles and questions, and where they came from: a data folder, the packaged file, the hub."""
    options = _options(task)
    local = _find_local(task, data_dir)
    if local is not None:
        try:
            return articles_from_squad(json.loads(local.read_text(encoding="utf-8"))), str(local.resolve())
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise UserError(f"task {task.name}: cannot read {local} as SQuAD JSON: {error}") from None
    if options["packaged"] is not None:
        packaged = Path(str(resources.files("bert_cluster") / "data" / str(options["packaged"])))
        if packaged.is_file():
            return read_packaged(packaged), str(packaged)
    if task.data.hub is None:
        raise UserError(f"task {task.name}: no data file found and no hub dataset configured")
    hub = task.data.hub
    try:
        import datasets

        rows = datasets.load_dataset(hub.path, hub.name, split=hub.split)
    except Exception as error:  # noqa: BLE001 - offline, unknown id, ...: one message says what was tried
        files = ", ".join(spec.path for spec in task.data.files)
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"task {task.name}: no local file ({files} in --data-dir) and the hub dataset {hub.path} is "
            f"unavailable: {reason}"
        ) from None
    return articles_from_rows(rows), f"hub:{hub.path}:{hub.split}"


def max_length_for(loaded: LoadedModel, settings: ScoreSettings) -> int:
    """Truncation: ``--max-length`` when given, at most (and by default) what the model's positions take."""
    limit = loaded.extra["max_positions"]
    wanted = settings.max_length or limit
    return min(wanted, limit)


def _encode(
    encoder: Any, texts: Sequence[str], batch_size: int, device: str, step: Callable[[int], None]
) -> tuple[torch.Tensor, float]:
    """Embeddings of ``texts`` through ``SentenceTransformer.encode`` and the wall time it took."""
    began, parts = time.perf_counter(), []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        parts.append(
            encoder.encode(
                chunk, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False, device=device
            )
            .float()
            .cpu()
        )
        step(len(chunk))
    return torch.cat(parts), time.perf_counter() - began


class LongRetrievalKind:
    """Article retrieval over whole documents: one embedding per article, questions as queries."""

    name = KIND

    def load_model(self, model: str | Path, task: Any, device: str) -> LoadedModel:
        """A SentenceTransformer (its own pooling and normalisation; mean pooling for a plain checkpoint).

        With ``options.long_position_proxy: N`` the task scores an untrained proxy of ``model`` whose
        position table is copied to N positions (``long_position_proxy``), built once into the cache.
        """
        from sentence_transformers import SentenceTransformer

        import bert_cluster  # noqa: F401 - re-applies a saved clustered-attention setting on load

        options = _options(task)
        source = Path(str(model)).expanduser()
        if options["long_position_proxy"] is not None:
            if not source.is_dir():
                raise UserError(
                    f"task {task.name} builds a long-position proxy of a local checkpoint folder, got {model}"
                )
            try:
                source = long_position_proxy(source, options["long_position_proxy"])
            except ValueError as error:
                raise UserError(f"task {task.name}: {error}") from None
        try:
            encoder = SentenceTransformer(str(source) if source.exists() else str(model), device=device)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(f"cannot load model {model!r} as a sentence encoder: {first}") from None
        encoder.eval()
        transformer = encoder.transformers_model
        if transformer is None:
            raise UserError(f"model {model!r} has no transformers model inside to patch")
        positions = model_max_positions(transformer.config) or encoder.max_seq_length
        if not positions:
            raise UserError(
                f"model {model!r}: cannot tell how many tokens it takes (no max_position_embeddings)"
            )
        proxy = source / "bert_cluster_proxy.json"
        return LoadedModel(
            model=transformer,
            tokenizer=encoder.tokenizer,
            extra={
                "encoder": encoder,
                "max_positions": positions,
                "path": str(source),
                "proxy": json.loads(proxy.read_text(encoding="utf-8")) if proxy.is_file() else None,
            },
        )

    def load_examples(self, task: Any, data_dir: Path | None, limit: int | None) -> Examples:
        """The articles and questions, sampled by the task's ``documents``/``questions`` and ``limit``."""
        _positive(task, "limit", limit)
        options = _options(task)
        articles, source = load_articles(task, data_dir)
        articles = select(articles, options["documents"], options["questions"], limit)
        if not articles.questions:
            raise UserError(f"task {task.name}: no questions to score in {source}")
        described = (
            f"{source} ({len(articles.documents)} articles as documents, {len(articles.questions)} questions"
        )
        if options["long_position_proxy"] is not None:
            described += (
                f"; model: an UNTRAINED proxy with positions copied to {options['long_position_proxy']:,} "
                "(p mod its original table)"
            )
        return Examples(items=articles, source=described + ")", count=len(articles.questions))

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """Recall@k and MRR@n x 100 of each question's article, plus the lengths and wall times measured.

        Besides the metrics, the result holds ``max_length`` (the truncation used), ``document_tokens``
        (tokens embedded), ``documents_time_s`` and ``queries_time_s`` (wall time of each part).
        """
        options = _options(task)
        articles: Articles = examples.items
        encoder = loaded.extra["encoder"]
        max_length = max_length_for(loaded, settings)
        encoder.max_seq_length = max_length
        total, done = len(articles.documents) + len(articles.questions), 0

        def step(count: int) -> None:
            nonlocal done
            done += count
            advance(done, total)

        advance(0, total)
        tokens = sum(
            sum(mask)
            for mask in encoder.tokenizer(
                articles.documents, truncation=True, max_length=max_length, return_attention_mask=True
            )["attention_mask"]
        )
        with torch.inference_mode():
            documents, documents_time = _encode(
                encoder, articles.documents, options["document_batch_size"], settings.device, step
            )
            queries, queries_time = _encode(
                encoder, articles.questions, settings.batch_size, settings.device, step
            )
        ranks = gold_ranks(queries, documents, articles.gold)
        return {
            **retrieval_metrics(ranks, options["recall_at"], options["mrr_at"]),
            "max_length": float(max_length),
            "document_tokens": float(tokens),
            "documents_time_s": documents_time,
            "queries_time_s": queries_time,
        }


LONG_RETRIEVAL = register_kind(LongRetrievalKind())
