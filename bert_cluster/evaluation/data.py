"""Reading a task's evaluation split: local files first (GLUE TSV, HF parquet, SQuAD JSON), then the hub.

Rows come back as dicts keyed by the task's canonical field names (those of the hub dataset), so a kind
never needs to know which layout a file was in. ``find_local`` searches every data folder and the
folders one level below it, so ``--data-dir ../shared/data`` serves ``glue/RTE/dev.tsv`` and
``squad/dev-v1.1.json`` alike.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.tasks import LocalFile, TaskConfig

#: Extra data folders, separated by ``os.pathsep``, searched after the ones passed explicitly.
DATA_DIR_ENV = "BERT_CLUSTER_DATA_DIR"


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
    env = os.environ.get(DATA_DIR_ENV, "")
    folders += [Path(part).expanduser() for part in env.split(os.pathsep) if part]
    return folders


def candidates(task: TaskConfig, folders: Sequence[Path]) -> list[tuple[str, LocalFile]]:
    """Every path pattern looked at, in search order, with the file spec it belongs to."""
    patterns: list[tuple[str, LocalFile]] = []
    for folder in folders:
        for spec in task.data.files:
            patterns.append((str(folder / spec.path), spec))
            patterns.append((str(folder / "*" / spec.path), spec))
    return patterns


def find_local(task: TaskConfig, folders: Sequence[Path]) -> tuple[Path, LocalFile] | None:
    """The first existing local file for ``task``, or None."""
    for pattern, spec in candidates(task, folders):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for match in matches:
            if os.path.isfile(match):
                return Path(match), spec
    return None


def _select(task: TaskConfig, spec: LocalFile, header: list[str] | None, row: list[str]) -> dict[str, Any]:
    wanted = [*task.text_fields, *([task.label_field] if task.label_field else [])]
    out: dict[str, Any] = {}
    for field in wanted:
        column = spec.columns.get(field, field)
        if isinstance(column, int):
            index = column
        else:
            if header is None or column not in header:
                raise UserError(f"column {column!r} (for {field!r}) not in the file's header {header}")
            index = header.index(column)
        try:
            out[field] = row[index]
        except IndexError:
            raise UserError(f"a row has {len(row)} fields; {field!r} is in column {index}") from None
    return out


def read_delimited(path: Path, task: TaskConfig, spec: LocalFile) -> list[dict[str, Any]]:
    """GLUE TSV/CSV with quoting as the spec says (off for the sentence files: their quotes are text)."""
    delimiter = "\t" if spec.format == "tsv" else ","
    quoting = csv.QUOTE_MINIMAL if spec.quoting else csv.QUOTE_NONE
    rows = []
    with open(path, encoding=spec.encoding, newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter, quoting=quoting)
        header = next(reader, None) if spec.header else None
        for number, row in enumerate(reader, start=2 if spec.header else 1):
            if not row:
                continue
            try:
                rows.append(_select(task, spec, header, row))
            except UserError as error:
                raise UserError(f"{path}, line {number}: {error}") from None
    return rows


def _plain(value: Any) -> Any:
    """Arrays and structs from parquet as plain Python lists and dicts."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def read_parquet(path: Path, task: TaskConfig, spec: LocalFile) -> list[dict[str, Any]]:
    """An HF parquet shard; columns renamed per the spec (usually nothing: they are the hub's names)."""
    import pandas as pd

    frame = pd.read_parquet(path)
    renames = {column: field for field, column in spec.columns.items() if isinstance(column, str)}
    frame = frame.rename(columns=renames)
    return [{key: _plain(value) for key, value in row.items()} for row in frame.to_dict(orient="records")]


def read_squad_json(path: Path) -> list[dict[str, Any]]:
    """The official SQuAD JSON (v1.1 or v2.0) as flat rows shaped like the hub dataset."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        articles = document["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise UserError(f"{path} is not a SQuAD JSON file ({type(error).__name__}: {error})") from None
    rows = []
    for article in articles:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                rows.append(
                    {
                        "id": qa["id"],
                        "title": article.get("title", ""),
                        "context": paragraph["context"],
                        "question": qa["question"],
                        "answers": {
                            "text": [answer["text"] for answer in answers],
                            "answer_start": [answer["answer_start"] for answer in answers],
                        },
                    }
                )
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per line."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def read_file(path: Path, task: TaskConfig, spec: LocalFile) -> list[dict[str, Any]]:
    """Read one local file in the spec's format."""
    if spec.format in ("tsv", "csv"):
        return read_delimited(path, task, spec)
    if spec.format == "parquet":
        return read_parquet(path, task, spec)
    if spec.format == "squad-json":
        return read_squad_json(path)
    if spec.format == "jsonl":
        return read_jsonl(path)
    raise UserError(f"unknown data file format {spec.format!r}")  # tasks.py validates: unreachable


def load_hub(task: TaskConfig) -> Rows:
    """``datasets.load_dataset`` for users who can reach the hub."""
    hub = task.data.hub
    assert hub is not None
    import datasets

    dataset = datasets.load_dataset(hub.path, hub.name, split=hub.split)
    rows = [{key: _plain(value) for key, value in row.items()} for row in dataset]
    name = f"/{hub.name}" if hub.name else ""
    return Rows(rows=rows, source=f"hub:{hub.path}{name}:{hub.split}")


def load_rows(
    task: TaskConfig, folders: Sequence[str | Path] | str | Path | None = None, limit: int | None = None
) -> Rows:
    """The task's evaluation rows, from the first local file found, else from the hub.

    Raises:
        UserError: nothing local and (no data folder was given and) the hub could not be read; the
            message names every path looked at.
    """
    if limit is not None and limit < 1:
        raise UserError(f"limit must be a positive number of examples, got {limit}")
    searched = data_dirs(folders)
    found = find_local(task, searched)
    if found is not None:
        path, spec = found
        rows = Rows(rows=read_file(path, task, spec), source=str(path.resolve()))
    else:
        looked = [pattern for pattern, _ in candidates(task, searched)]
        where = f"looked at: {', '.join(looked)}" if looked else "no --data-dir given"
        if task.data.hub is None or searched:
            # An explicit data folder means "offline": do not wait on an unreachable hub.
            raise UserError(f"no data file for task {task.name} ({where})")
        try:
            rows = load_hub(task)
        except Exception as error:  # noqa: BLE001 - any failure means: not reachable here
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(
                f"no data for task {task.name}: {where}, and the hub dataset {task.data.hub.path} could not "
                f"be loaded ({first}); pass --data-dir with the task's files"
            ) from None
    if limit is not None:
        rows.rows = rows.rows[:limit]
    if not rows.rows:
        raise UserError(f"task {task.name}: {rows.source} holds no examples")
    return rows
