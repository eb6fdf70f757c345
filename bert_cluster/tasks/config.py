"""Task definitions as data: ``configs/tasks/**/*.yaml`` loaded into validated ``TaskConfig`` objects.

A task file names its kind (``classification``, ``squad``, ``sts-embedding``, ...), where its dev data
lives (local files in one or more layouts, and the hub dataset for users who can reach it), which
fields hold the text and the label, the label names in the dataset's order, the metrics with their
display names and the default lengths. Anything a single kind needs goes under ``options``.
A file may start from another with ``include: other.yaml`` (relative to itself) and override keys;
mappings merge recursively, everything else is replaced.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from bert_cluster import environment
from bert_cluster.errors import UserError, one_line

#: Local file formats ``data.py`` reads (each through ``datasets.load_dataset``): TSV/CSV, parquet, JSON
#: lines or a JSON list, the official SQuAD JSON, the packaged retrieval JSON (paragraphs + questions), and
#: the ``.py`` source files of an installed Python package (``path``: its import name; ``version``: the
#: version pinned, refused if another is installed), one row per file (``path``, ``text``).
FILE_FORMATS = ("tsv", "csv", "parquet", "json", "jsonl", "squad-json", "retrieval-json", "package-source")

_TOP_KEYS = {
    "name",
    "kind",
    "version",
    "description",
    "data",
    "text_fields",
    "label_field",
    "label_names",
    "metrics",
    "max_length",
    "batch_size",
    "options",
    "include",
    "metadata",
    "train",
}
_DATA_KEYS = {"hub", "files"}
_TRAIN_KEYS = {"hub", "files", "loss"}
#: The losses a ``train:`` split may name (``bert-cluster finetune``): what the model's own head computes
#: from the labels (classes, a regression score, a SQuAD answer span); a question against the articles
#: (long-document retrieval: in-batch negatives, or also a bank of every training article); the masked
#: tokens (masked-LM pretraining).
TRAIN_LOSSES = ("cross-entropy", "mse", "span-cross-entropy", "contrastive", "contrastive-bank", "masked-lm")
_HUB_KEYS = {"path", "name", "split"}
_FILE_KEYS = {"path", "format", "header", "columns", "quoting", "encoding", "packaged", "articles", "version"}


def config_root() -> Path:
    """The ``configs`` folder: ``$BERT_CLUSTER_CONFIGS``, inside the package, or at the repository root."""
    explicit = environment.configs_dir()
    if explicit is not None:
        return explicit
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "configs", package.parent / "configs"):
        if (candidate / "tasks").is_dir():
            return candidate
    return package.parent / "configs"


@dataclasses.dataclass(frozen=True)
class HubSpec:
    """A ``datasets.load_dataset(path, name, split=split)`` call, for users who can reach the hub."""

    path: str
    name: str | None = None
    split: str = "validation"


@dataclasses.dataclass(frozen=True)
class LocalFile:
    """One local file a task can be read from, relative to a data folder.

    Attributes:
        path: relative path; may hold ``*`` (``mnli/validation_matched-*.parquet``).
        format: one of ``FILE_FORMATS``.
        header: whether a TSV/CSV file starts with a header line.
        columns: canonical field -> column in this file (a header name, or an int position; -1 = last).
            Fields not named keep their own name.
        quoting: honour double quotes in TSV/CSV (GLUE's sentence files need this off).
        encoding: text encoding (``utf-8-sig`` drops MRPC's byte-order mark).
        packaged: the file ships in ``bert_cluster/data`` (searched after the user's data folders).
        articles: ``(first, last)``, 1-based and inclusive: only these articles of a ``squad-json`` or
            ``retrieval-json`` file (a split of SQuAD dev by article, as the ``minilm-l6-squad`` checkpoint
            was trained).
        version: a ``package-source`` file's pinned package version.
    """

    path: str
    format: str
    header: bool = True
    columns: Mapping[str, str | int] = dataclasses.field(default_factory=dict)
    quoting: bool = False
    encoding: str = "utf-8-sig"
    packaged: bool = False
    articles: tuple[int, int] | None = None
    version: str | None = None


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where a task's evaluation split lives: local candidates first, then the hub."""

    files: tuple[LocalFile, ...] = ()
    hub: HubSpec | None = None


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Where a task's training split lives and the loss it is trained with (``bert-cluster finetune``)."""

    data: DataSpec
    loss: str


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """A metric as the kind computes it (``name``) and as tables show it (``display``)."""

    name: str
    display: str


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """One evaluation task, as read from its YAML file.

    Attributes:
        name: the name users pass to ``--task``.
        kind: the registered ``TaskKind`` that loads and scores it.
        version: bumped when the data, preprocessing or metric changes (goes into results.json).
        description: one line for ``bert-cluster ls``.
        data: local files and hub dataset.
        text_fields: the canonical fields holding the input text(s), in model-input order.
        label_field: the canonical field holding the gold label (None: the kind knows).
        label_names: label names in the dataset's index order (None: regression or not applicable).
        metrics: what ``score`` returns, in display order.
        max_length: default truncation length in tokens.
        batch_size: default batch size.
        options: kind-specific settings (e.g. SQuAD's ``doc_stride``); validated by the kind.
        source: the YAML file this came from.
        train: the training split and its loss (None: the task cannot be fine-tuned on).
    """

    name: str
    kind: str
    version: int
    description: str
    data: DataSpec
    text_fields: tuple[str, ...] = ()
    label_field: str | None = None
    label_names: tuple[str, ...] | None = None
    metrics: tuple[MetricSpec, ...] = ()
    max_length: int = 512
    batch_size: int = 32
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None
    train: TrainSpec | None = None

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metric keys ``score`` returns."""
        return tuple(metric.name for metric in self.metrics)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (as recorded in results.json)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples as lists, as read back


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def read_mapping(path: Path, what: str, empty: bool = False) -> dict[str, Any]:
    """A YAML file holding one mapping: a task file, or the default run beside them (``empty``: may be empty).

    Raises:
        UserError: the file is unreadable, not YAML, or not a mapping (``what`` names it in the message).
    """
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise UserError(f"{path}: not valid YAML: {one_line(error)}") from None
    if raw is None and empty:
        return {}
    if not isinstance(raw, Mapping):
        raise UserError(f"{path}: {what} must be a mapping, got {type(raw).__name__}")
    return dict(raw)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read ``path`` and resolve its ``include:`` chain."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: include cycle through {[str(p) for p in seen]}")
    raw = read_mapping(path, "a task file")
    include = raw.pop("include", None)
    if include is None:
        return raw
    if not isinstance(include, str):
        raise UserError(f"{path}: include must be a file name, got {include!r}")
    return _merge(_read_yaml(path.parent / include, (*seen, path)), raw)


def _require(where: str, condition: bool, message: str) -> None:
    if not condition:
        raise UserError(f"{where}: {message}")


def _check_keys(where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    _require(where, not unknown, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _parse_file(where: str, raw: Any) -> LocalFile:
    _require(where, isinstance(raw, Mapping), f"each data.files entry must be a mapping, got {raw!r}")
    _check_keys(where, raw, _FILE_KEYS)
    _require(where, isinstance(raw.get("path"), str) and raw["path"], "data.files entry needs a path")
    fmt = raw.get("format")
    _require(where, fmt in FILE_FORMATS, f"data file format must be one of {FILE_FORMATS}, got {fmt!r}")
    columns = raw.get("columns", {}) or {}
    _require(where, isinstance(columns, Mapping), f"columns must be a mapping, got {columns!r}")
    for field, column in columns.items():
        ok = isinstance(column, str) or (isinstance(column, int) and not isinstance(column, bool))
        _require(where, ok, f"column for {field!r} must be a name or an int position, got {column!r}")
    for flag in ("header", "quoting", "packaged"):
        _require(where, isinstance(raw.get(flag, True), bool), f"{flag} must be true or false")
    articles = raw.get("articles")
    if articles is not None:
        _require(
            where,
            fmt in ("squad-json", "retrieval-json")
            and isinstance(articles, list)
            and len(articles) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in articles)
            and 1 <= articles[0] <= articles[1],
            "articles must be [first, last] (1-based, first <= last) of a squad-json or retrieval-json "
            f"file, got {articles!r}",
        )
        articles = (articles[0], articles[1])
    version = raw.get("version")
    _require(
        where,
        version is None or (fmt == "package-source" and isinstance(version, str)),
        f"version (a string) belongs to a package-source file, got {version!r}",
    )
    return LocalFile(
        version=version,
        path=raw["path"],
        format=fmt,
        header=raw.get("header", True),
        columns=dict(columns),
        quoting=raw.get("quoting", False),
        encoding=raw.get("encoding", "utf-8-sig"),
        packaged=raw.get("packaged", False),
        articles=articles,
    )


def _parse_data(where: str, data: Any, keys: set[str], split: str) -> DataSpec:
    """A ``data:`` (or ``train:``) mapping: local files, then the hub dataset (``split`` by default)."""
    _require(where, isinstance(data, Mapping), "must be a mapping")
    _check_keys(where, data, keys)
    files = data.get("files") or []
    _require(where, isinstance(files, list), "files must be a list")
    hub = data.get("hub")
    hub_spec = None
    if hub is not None:
        _require(where, isinstance(hub, Mapping), "hub must be a mapping")
        _check_keys(where + " hub", hub, _HUB_KEYS)
        _require(where, isinstance(hub.get("path"), str), "hub needs a path (a hub dataset id)")
        hub_spec = HubSpec(path=hub["path"], name=hub.get("name"), split=hub.get("split", split))
    return DataSpec(files=tuple(_parse_file(where, item) for item in files), hub=hub_spec)


def parse_task(raw: Mapping[str, Any], source: str | None = None) -> TaskConfig:
    """Validate a task mapping (a YAML file after ``include``) into a ``TaskConfig``."""
    where = source or str(raw.get("name", "<task>"))
    _check_keys(where, raw, _TOP_KEYS)
    name, kind = raw.get("name"), raw.get("kind")
    _require(where, isinstance(name, str) and name.strip() != "", "name must be a non-empty string")
    _require(where, isinstance(kind, str) and kind.strip() != "", "kind must be a non-empty string")
    metadata = raw.get("metadata") or {}
    _require(where, isinstance(metadata, Mapping), "metadata must be a mapping")
    version = raw.get("version", metadata.get("version"))
    _require(
        where,
        isinstance(version, int) and not isinstance(version, bool) and version >= 0,
        f"version must be a non-negative int, got {version!r}",
    )

    data = raw.get("data") or {}
    _require(where, isinstance(data, Mapping), "data must be a mapping")
    spec = _parse_data(where + " data", data, _DATA_KEYS, "validation")
    train = None
    if raw.get("train") is not None:
        _require(where, isinstance(raw["train"], Mapping), "train must be a mapping")
        loss = raw["train"].get("loss")
        _require(where, loss in TRAIN_LOSSES, f"train.loss must be one of {TRAIN_LOSSES}, got {loss!r}")
        train = TrainSpec(data=_parse_data(where + " train", raw["train"], _TRAIN_KEYS, "train"), loss=loss)

    text_fields = raw.get("text_fields") or []
    _require(
        where,
        isinstance(text_fields, list) and all(isinstance(f, str) for f in text_fields),
        "text_fields must be a list of field names",
    )
    label_field = raw.get("label_field")
    _require(where, label_field is None or isinstance(label_field, str), "label_field must be a string")
    label_names = raw.get("label_names")
    if label_names is not None:
        _require(
            where,
            isinstance(label_names, list)
            and all(isinstance(n, str) for n in label_names)
            and len(set(label_names)) == len(label_names)
            and label_names,
            "label_names must be a list of distinct strings",
        )
        label_names = tuple(label_names)

    metrics = []
    for item in raw.get("metrics") or []:
        if isinstance(item, str):
            item = {"name": item}
        _require(
            where,
            isinstance(item, Mapping) and isinstance(item.get("name"), str),
            f"each metric must be a name or {{name, display}}, got {item!r}",
        )
        _check_keys(where + " metric", item, {"name", "display"})
        metrics.append(MetricSpec(name=item["name"], display=str(item.get("display", item["name"]))))
    _require(where, len({m.name for m in metrics}) == len(metrics), "metric names must be distinct")

    for key, default in (("max_length", 512), ("batch_size", 32)):
        value = raw.get(key, default)
        _require(
            where,
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            f"{key} must be a positive int, got {value!r}",
        )
    options = raw.get("options") or {}
    _require(where, isinstance(options, Mapping), "options must be a mapping")
    description = raw.get("description", "")
    _require(where, isinstance(description, str), "description must be a string")
    return TaskConfig(
        name=name.strip(),
        kind=kind.strip(),
        version=version,
        description=" ".join(description.split()),
        data=spec,
        text_fields=tuple(text_fields),
        label_field=label_field,
        label_names=label_names,
        metrics=tuple(metrics),
        max_length=raw.get("max_length", 512),
        batch_size=raw.get("batch_size", 32),
        options=dict(options),
        source=source,
        train=train,
    )


def load_task_file(path: str | Path) -> TaskConfig:
    """Read and validate one task YAML file (following ``include:``)."""
    path = Path(path)
    return parse_task(_read_yaml(path), source=str(path))


def task_files(root: Path | None = None) -> list[Path]:
    """Every task YAML under ``root/tasks`` (default: ``config_root()``), sorted.

    Raises:
        UserError: the folder does not exist (a wrong ``$BERT_CLUSTER_CONFIGS`` would otherwise mean
            "no tasks" and every name would look unknown).
    """
    root = root or config_root()
    if not (root / "tasks").is_dir():
        raise UserError(
            f"the task configs folder {root / 'tasks'} does not exist; set BERT_CLUSTER_CONFIGS to a folder "
            "holding tasks/**/*.yaml"
        )
    return sorted((root / "tasks").rglob("*.yaml"))


@dataclasses.dataclass
class TaskCatalog:
    """The tasks that loaded, by name, and one line per file that did not (it blocks nothing else)."""

    tasks: dict[str, TaskConfig]
    problems: list[str]


def load_catalog(root: Path | None = None) -> TaskCatalog:
    """Read every task file; a file that fails, or repeats an earlier file's name, becomes a problem line."""
    tasks: dict[str, TaskConfig] = {}
    problems: list[str] = []
    for path in task_files(root):
        try:
            task = load_task_file(path)
        except UserError as error:
            problems.append(str(error))
            continue
        if task.name in tasks:
            problems.append(f"task name {task.name!r} is defined twice: {tasks[task.name].source} and {path}")
            continue
        tasks[task.name] = task
    return TaskCatalog(tasks, problems)


def load_tasks(root: Path | None = None) -> dict[str, TaskConfig]:
    """The tasks that load, by name (see ``load_catalog`` for the files that do not)."""
    return load_catalog(root).tasks


def get_tasks(names: str | list[str] | tuple[str, ...], root: Path | None = None) -> list[TaskConfig]:
    """Resolve task names (a list or one comma-separated string) to configs, in the order given."""
    if isinstance(names, str):
        names = [names]
    wanted = [part.strip() for name in names for part in str(name).split(",") if part.strip()]
    if not wanted:
        raise UserError("no task given; see `bert-cluster ls` for the task names")
    catalog = load_catalog(root)
    unknown = [name for name in wanted if name not in catalog.tasks]
    if unknown:
        broken = (
            f"; {len(catalog.problems)} task file(s) did not load: {catalog.problems[0]}"
            if catalog.problems
            else ""
        )
        raise UserError(
            f"unknown task(s) {', '.join(unknown)}; known: {', '.join(sorted(catalog.tasks))}{broken}"
        )
    return [catalog.tasks[name] for name in dict.fromkeys(wanted)]


_GENERIC = re.compile(r"label_?\d+")


def _normal(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", str(name).lower())


def label_mapping(id2label: Mapping[Any, str], num_labels: int, task: TaskConfig) -> list[int] | None:
    """Model output index -> dataset label index, or None for "same order" (and for regression).

    Raises:
        UserError: the head has the wrong number of outputs, or its label names are not the task's.
    """
    names = task.label_names
    if names is None:
        if num_labels != 1:
            raise UserError(
                f"task {task.name} is a regression (one output); the model's head has {num_labels}"
            )
        return None
    if num_labels != len(names):
        raise UserError(
            f"task {task.name} has {len(names)} labels ({', '.join(names)}); "
            f"the model's head has {num_labels}"
        )
    model_names = [
        str(id2label.get(index, id2label.get(str(index), f"LABEL_{index}"))) for index in range(num_labels)
    ]
    if all(_GENERIC.fullmatch(_normal(name)) for name in model_names):
        return None
    wanted = [_normal(name) for name in names]
    given = [_normal(name) for name in model_names]
    if sorted(wanted) != sorted(given):
        raise UserError(
            f"the model's labels {model_names} do not match task {task.name}'s labels {list(names)}; "
            "refusing to guess the mapping (rename the checkpoint's id2label)"
        )
    mapping = [wanted.index(name) for name in given]
    return None if mapping == list(range(num_labels)) else mapping


def label_index(value: Any, task: TaskConfig) -> int | float:
    """A gold label as the dataset's index (or a float score): accepts indices and label names."""
    if task.label_names is None:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"task {task.name}: regression label {value!r} is not a number") from None
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            value = int(text)
        else:
            normal = [_normal(name) for name in task.label_names]
            if _normal(text) not in normal:
                raise UserError(f"task {task.name}: label {value!r} is not one of {list(task.label_names)}")
            return normal.index(_normal(text))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not 0 <= value < len(task.label_names):
        raise UserError(f"task {task.name}: label {value!r} is not an index into {list(task.label_names)}")
    return value
