"""Every task's rows through one call, ``datasets.load_dataset``: the user's files, packaged ones, the hub.

Local files are read with the format's packaged builder (``csv``, ``parquet``, ``json``) and ``data_files=``;
a task with no local file asks the hub with ``load_dataset(path, name, split=...)``. Rows come back as
dicts keyed by the task's canonical field names (the hub dataset's), so a kind never needs to know which
layout a file was in. ``find_local`` searches every data folder and the folders one level below it, so
``--data-dir ../shared/data`` serves ``glue/RTE/dev.tsv`` and ``squad/dev-v1.1.json`` alike; files marked
``packaged`` are looked for in ``bert_cluster/data`` after the user's folders.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bert_cluster import environment
from bert_cluster.datafiles import PACKAGE_DATA, load_dataset
from bert_cluster.errors import UserError, one_line
from bert_cluster.tasks.config import DataSpec, LocalFile, TaskConfig, get_tasks

#: The splits a task may have: ``dev`` (its ``data:``, what evaluation scores) and ``train`` (its
#: ``train:``, what ``finetune`` trains on).
SPLITS = ("dev", "train")

#: Extra data folders, separated by ``os.pathsep``, searched after the ones passed explicitly.
DATA_DIR_ENV = environment.DATA_DIR


@dataclasses.dataclass
class Rows:
    """A task's rows and where they came from (a file path, or ``hub:path/name:split``)."""

    rows: list[dict[str, Any]]
    source: str


def data_dirs(explicit: Sequence[str | Path] | str | Path | None) -> list[Path]:
    """The folders to search: those given, then ``$BERT_CLUSTER_DATA_DIR``."""
    if explicit is None:
        explicit = []
    elif isinstance(explicit, (str, Path)):
        explicit = [explicit]
    folders = [Path(folder).expanduser() for folder in explicit]
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"data folder {folder} does not exist or is not a folder")
    return folders + environment.data_dirs()


def split_data(task: TaskConfig, split: str = "dev") -> DataSpec:
    """Where ``split`` of ``task`` lives.

    Raises:
        UserError: an unknown split, or a task without a ``train:`` split asked for it.
    """
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    if split == "dev":
        return task.data
    if task.train is None:
        raise UserError(f"task {task.name} has no train split (no train: in {task.source or 'its config'})")
    return task.train.data


def candidates(task: TaskConfig, folders: Sequence[Path], split: str = "dev") -> list[tuple[str, LocalFile]]:
    """Every path pattern looked at, in search order, with the file spec it belongs to."""
    files = split_data(task, split).files
    installed = [spec for spec in files if spec.format == "package-source"]
    patterns = [
        (str(folder / prefix / spec.path), spec)
        for folder in folders
        for spec in files
        if not spec.packaged and spec not in installed
        for prefix in ("", "*")
    ]
    packaged = [(str(PACKAGE_DATA / spec.path), spec) for spec in files if spec.packaged]
    return patterns + packaged + [(_package_folder(spec.path), spec) for spec in installed]


def _package_folder(name: str) -> str:
    """The folder of the installed Python package ``name`` (a path that does not exist if it is not)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    return locations[0] if locations else f"<package {name} is not installed>"


def find_local(
    task: TaskConfig, folders: Sequence[Path], split: str = "dev"
) -> tuple[Path, LocalFile] | None:
    """The first existing local file for ``split`` of ``task``, or None."""
    for pattern, spec in candidates(task, folders, split):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for match in matches:
            if os.path.isfile(match) or (spec.format == "package-source" and os.path.isdir(match)):
                return Path(match), spec
    return None


def _read_delimited(path: Path, spec: LocalFile) -> Any:
    """TSV/CSV as strings: quoting as the spec says (off for GLUE: its quotes are text), no NA guessing."""
    import datasets
    import pandas as pd

    options: dict[str, Any] = {
        "sep": "\t" if spec.format == "tsv" else ",",
        "quoting": csv.QUOTE_MINIMAL if spec.quoting else csv.QUOTE_NONE,
        "encoding": spec.encoding,
        "header": 0 if spec.header else None,
    }
    # Every column as a string: pandas would otherwise guess types per chunk (and read "NA" as missing).
    first = pd.read_csv(path, nrows=1, **options)
    names = [str(name) for name in first.columns]
    if not spec.header:
        options["column_names"] = names
    features = datasets.Features({name: datasets.Value("string") for name in names})
    return load_dataset(
        "csv",
        data_files=str(path),
        split="train",
        features=features,
        keep_default_na=False,
        na_filter=False,
        **options,
    )


def _squad_rows(articles: Any, path: Path, chosen: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """The official SQuAD JSON (v1.1 or v2.0) as flat rows shaped like the hub dataset.

    ``chosen``: only articles first..last (1-based, inclusive), e.g. a split of dev by article.
    """
    articles = list(articles)
    if chosen is not None:
        first, last = chosen
        if last > len(articles):
            raise UserError(f"{path} has {len(articles)} articles; the task asks for articles {first}-{last}")
        articles = articles[first - 1 : last]
    rows = []
    for article in articles:
        for paragraph in article["paragraphs"] or []:
            for qa in paragraph["qas"] or []:
                if not qa.get("id"):
                    raise UserError(
                        f"{path}: the question {qa.get('question')!r} (article {article.get('title')!r}) has "
                        "no id; every SQuAD question needs one"
                    )
                answers = [] if qa.get("is_impossible") else qa.get("answers") or []
                rows.append(
                    {
                        "id": qa["id"],
                        "title": article.get("title") or "",
                        "context": paragraph["context"],
                        "question": qa["question"],
                        "answers": {
                            "text": [answer["text"] for answer in answers],
                            "answer_start": [answer["answer_start"] for answer in answers],
                        },
                    }
                )
    return rows


def _retrieval_rows(path: Path, chosen: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """The packaged retrieval file (paragraphs, questions with their paragraph id) as flat QA rows.

    ``chosen``: only articles first..last (1-based, inclusive, in the file's order of paragraphs).
    """
    paragraphs = load_dataset("json", data_files=str(path), field="paragraphs", split="train")
    questions = load_dataset("json", data_files=str(path), field="questions", split="train")
    context = dict(zip(paragraphs["id"], paragraphs["context"], strict=True))
    if chosen is not None:
        titles = list(dict.fromkeys(paragraph.rsplit("/", 1)[0] for paragraph in paragraphs["id"]))
        first, last = chosen
        if last > len(titles):
            raise UserError(f"{path} has {len(titles)} articles; the task asks for articles {first}-{last}")
        kept = set(titles[first - 1 : last])
        questions = [row for row in questions if row["paragraph"].rsplit("/", 1)[0] in kept]
    return [
        {
            "id": row["id"],
            "title": row["paragraph"].rsplit("/", 1)[0],
            "passage_id": row["paragraph"],
            "context": context[row["paragraph"]],
            "question": row["question"],
        }
        for row in questions
    ]


def _source_rows(folder: Path, spec: LocalFile) -> list[dict[str, Any]]:
    """Every ``.py`` file of an installed package, one row each (``path`` inside the package, ``text``).

    Raises:
        UserError: another version of the package is installed than the task pins.
    """
    from importlib import metadata

    if spec.version is not None:
        installed = metadata.version(spec.path)
        if installed != spec.version:
            raise UserError(
                f"the task reads {spec.path} {spec.version}'s source files; {installed} is installed "
                f"(pip install {spec.path}=={spec.version})"
            )
    return [
        {"path": str(file.relative_to(folder)), "text": file.read_text(encoding="utf-8", errors="replace")}
        for file in sorted(folder.rglob("*.py"))
    ]


def _rename(task: TaskConfig, spec: LocalFile, rows: list[dict[str, Any]], names: list[str]) -> list[dict]:
    """Rows keyed by the task's fields; ``spec.columns`` maps a field to a column name or position."""
    mapping = {}
    for field, column in spec.columns.items():
        if isinstance(column, int):
            if not -len(names) <= column < len(names):
                raise UserError(f"{field!r} is in column {column}, but the file has {len(names)} columns")
            column = names[column]
        elif column not in names:
            raise UserError(f"column {column!r} (for {field!r}) is not in the file's columns {names}")
        mapping[column] = field
    wanted = [*task.text_fields, *([task.label_field] if task.label_field else [])]
    missing = [field for field in wanted if field not in mapping.values() and field not in names]
    if missing:
        raise UserError(f"no column for {missing} among the file's columns {names}")
    return [{mapping.get(key, key): value for key, value in row.items()} for row in rows]


def read_file(path: Path, task: TaskConfig, spec: LocalFile) -> list[dict[str, Any]]:
    """Read one local file in the spec's format as rows keyed by the task's fields."""
    try:
        if spec.format in ("tsv", "csv"):
            dataset = _read_delimited(path, spec)
        elif spec.format == "parquet":
            dataset = load_dataset("parquet", data_files=str(path), split="train")
        elif spec.format in ("json", "jsonl"):
            dataset = load_dataset("json", data_files=str(path), split="train")
        elif spec.format == "package-source":
            return _source_rows(path, spec)
        elif spec.format == "squad-json":
            data = load_dataset("json", data_files=str(path), field="data", split="train")
            return _squad_rows(data, path, spec.articles)
        else:  # retrieval-json; tasks.py allows nothing else
            return _retrieval_rows(path, spec.articles)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - a malformed file: say which, in one line
        raise UserError(f"cannot read {path} as {spec.format}: {one_line(error)}") from None
    try:
        return _rename(task, spec, dataset.to_list(), dataset.column_names)
    except UserError as error:
        raise UserError(f"{path}: {error}") from None


def load_hub(task: TaskConfig, split: str = "dev") -> Rows:
    """``datasets.load_dataset(path, name, split=...)`` for users who can reach the hub."""
    hub = split_data(task, split).hub
    assert hub is not None
    dataset = load_dataset(hub.path, hub.name, split=hub.split)
    name = f"/{hub.name}" if hub.name else ""
    return Rows(rows=dataset.to_list(), source=f"hub:{hub.path}{name}:{hub.split}")


def load_rows(
    task: TaskConfig, folders: Sequence[str | Path] | str | Path | None = None, split: str = "dev"
) -> Rows:
    """The task's rows of ``split`` (``dev``: what evaluation scores; ``train``), local first, else the hub.

    Raises:
        UserError: nothing local and (no data folder was given and) the hub could not be read; the
            message names every path looked at.
    """
    searched = data_dirs(folders)
    spec_data = split_data(task, split)
    named = "" if split == "dev" else f"{split} "  # the dev split's messages as they always were
    found = find_local(task, searched, split)
    if found is not None:
        path, spec = found
        rows = Rows(rows=read_file(path, task, spec), source=str(path.resolve()))
    else:
        looked = [pattern for pattern, _ in candidates(task, searched, split)]
        where = f"looked at: {', '.join(looked)}" if looked else "no --data-dir given"
        if spec_data.hub is None or searched:
            # An explicit data folder means "offline": do not wait on an unreachable hub.
            raise UserError(f"no {named}data file for task {task.name} ({where})")
        try:
            rows = load_hub(task, split)
        except Exception as error:  # noqa: BLE001 - any failure means: not reachable here
            raise UserError(
                f"no {named}data for task {task.name}: {where}, and the hub dataset {spec_data.hub.path} "
                f"could not be loaded ({one_line(error)}); pass --data-dir with the task's files"
            ) from None
    if not rows.rows:
        raise UserError(f"task {task.name}: {rows.source} holds no examples")
    return rows


def locator(task: TaskConfig, data_dir: Any, source: str, count: int) -> Callable[[int, dict[str, Any]], str]:
    """Where each of the ``count`` train rows ``load_rows`` read from ``source`` is, for messages.

    A line of a TSV/CSV file, a question id of a SQuAD file, else a row number (from 1).
    """
    found = find_local(task, data_dirs(data_dir), split="train")
    if found is None or str(found[0].resolve()) != source:  # the hub
        return lambda index, row: f"{source} row {index + 1}"
    path, spec = found
    if spec.format == "squad-json":
        return lambda index, row: f"{path} question {row.get('id')!r}"
    if spec.format not in ("tsv", "csv"):
        return lambda index, row: f"{path} row {index + 1}"
    lines: list[int] = []

    def where(index: int, row: dict[str, Any]) -> str:
        if not lines:
            lines.extend(_row_lines(path, spec))
        if len(lines) != count:  # read otherwise than pandas did: say the row, not a wrong line
            return f"{path} row {index + 1}"
        return f"{path} line {lines[index]}"

    return where


def _row_lines(path: Path, spec: LocalFile) -> list[int]:
    """The line each row of a TSV/CSV file starts on, as pandas reads it (blank lines skipped)."""
    quoting = csv.QUOTE_MINIMAL if spec.quoting else csv.QUOTE_NONE
    limit = csv.field_size_limit(sys.maxsize)
    starts, start = [], 1
    try:
        with open(path, encoding=spec.encoding, newline="") as handle:
            reader = csv.reader(handle, delimiter="\t" if spec.format == "tsv" else ",", quoting=quoting)
            for cells in reader:
                if cells:
                    starts.append(start)
                start = reader.line_num + 1
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    finally:
        csv.field_size_limit(limit)
    return starts[1:] if spec.header else starts


def load_task_texts(
    task: str, data_dir: str | Path | Sequence[str | Path] | None = None, limit: int = 16
) -> list[str] | list[tuple[str, str]]:
    """The first ``limit`` inputs of an evaluation task (its ``text_fields``), as texts or text pairs.

    What ``bert-cluster inspect --task`` inspects the model on.
    """
    (config,) = get_tasks(task)
    folders = [data_dir] if isinstance(data_dir, (str, Path)) else data_dir
    rows = load_rows(config, list(folders) if folders else None).rows[:limit]
    fields = list(config.text_fields)
    if len(fields) == 1:
        return [str(row[fields[0]]) for row in rows]
    return [(str(row[fields[0]]), str(row[fields[1]])) for row in rows]
