"""Reading an embed input into documents, with every document that cannot be embedded recorded.

A plain text file is read here, as bytes, one document a line, so that an undecodable line is reported
with its line number. JSONL, JSON, CSV and parquet files, ``datasets`` folders (``save_to_disk``) and
dataset names (the hub, when online) go through ``datasets``. ``package:squad-articles`` names the 48
SQuAD v1.1 dev articles shipped in ``bert_cluster/data`` (the long documents of the demo).
Empty, whitespace-only, undecodable or non-string texts and repeated ids become ``Problem`` records:
never dropped silently, never embedded.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from bert_cluster.errors import UserError, one_line

#: File endings read through ``datasets.load_dataset(<builder>, data_files=...)`` (with or without .gz).
TABLE_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".parquet": "parquet"}
#: The packaged corpora an input may name (``package:NAME``).
PACKAGED = ("squad-articles",)
PACKAGE_PREFIX = "package:"


@dataclasses.dataclass(frozen=True)
class Document:
    """One text to embed; ``line`` is its line in a text or JSONL file, else its row number (from 1)."""

    id: str
    text: str
    line: int


@dataclasses.dataclass(frozen=True)
class Problem:
    """A document that is not embedded, and why."""

    id: str
    line: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the manifest's ``problems``)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Corpus:
    """The documents of an input, its problems, where it came from and a hash of its content."""

    documents: list[Document]
    problems: list[Problem]
    source: str
    #: sha256 over every id and text (and each problem): a resume checks it, whatever the format.
    fingerprint: str


def _text_problem(text: Any) -> str | None:
    """Why ``text`` cannot be embedded, or None."""
    if text is None:
        return "no text (missing or null)"
    if not isinstance(text, str):
        return f"the text is a {type(text).__name__}, not a string"
    if not text:
        return "empty"
    if not text.strip():
        return "whitespace only"
    return None


class _Collector:
    """Documents and problems as they are read, with repeated ids caught and the content hashed."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.documents: list[Document] = []
        self.problems: list[Problem] = []
        self.first_line: dict[str, int] = {}
        self.digest = hashlib.sha256()

    def add(self, identifier: Any, text: Any, line: int) -> None:
        identifier = str(line) if identifier is None else str(identifier)
        reason = _text_problem(text)
        if reason is None and identifier in self.first_line:
            reason = f"repeated id (first at line {self.first_line[identifier]})"
        if reason is not None:
            self.problems.append(Problem(identifier, line, reason))
            self.digest.update(f"P\0{identifier}\0{line}\0{reason}\0".encode())
            return
        self.first_line[identifier] = line
        self.documents.append(Document(identifier, text, line))
        self.digest.update(f"D\0{identifier}\0{line}\0".encode())
        self.digest.update(text.encode("utf-8", "surrogatepass"))

    def corpus(self) -> Corpus:
        return Corpus(self.documents, self.problems, self.source, self.digest.hexdigest())


def read_text_lines(path: Path) -> Corpus:
    """One document a line (LF or CRLF); ids are line numbers; a final newline ends the last line."""
    collector = _Collector(str(path))
    data = path.read_bytes()
    if path.suffix == ".gz":
        import gzip

        data = gzip.decompress(data)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        raw = raw.removesuffix(b"\r")
        if number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark is not text
        try:
            text: Any = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            collector.problems.append(
                Problem(str(number), number, f"not valid UTF-8 (byte {error.start + 1} of the line)")
            )
            collector.digest.update(f"P\0{number}\0undecodable\0".encode() + raw)
            continue
        collector.add(None, text, number)
    return collector.corpus()


def _rows(dataset: Any, source: str, text_field: str, id_field: str | None) -> Corpus:
    collector = _Collector(source)
    number = 0
    for batch in dataset.iter(batch_size=4096):  # columns at a time: much faster than row dicts
        ids = batch[id_field] if id_field else [None] * len(batch[text_field])
        for identifier, text in zip(ids, batch[text_field], strict=True):
            number += 1
            collector.add(identifier, text, number)
    return collector.corpus()


def _check_fields(columns: list[str], source: str, text_field: str | None, id_field: str | None) -> str:
    if text_field is None:
        if "text" in columns:
            text_field = "text"
        else:
            raise UserError(f"{source}: give --text-field (the column of the texts); columns: {columns}")
    for option, name in (("--text-field", text_field), ("--id-field", id_field)):
        if name is not None and name not in columns:
            raise UserError(f"{source}: {option} {name!r} is not a column; columns: {columns}")
    return text_field


def _load_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` quietly, with its failures as one-line ``UserError``s."""
    from bert_cluster.datafiles import load_dataset as load

    try:
        return load(*args, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"cannot read {args[0] if args else 'the input'}: {one_line(error)}") from None
    except Exception as error:  # datasets' own errors (DatasetGenerationError, ...) derive from Exception
        raise UserError(f"cannot read the input: {type(error).__name__}: {one_line(error)}") from None


def _one_split(loaded: Any, source: str, split: str | None) -> Any:
    """A ``Dataset`` from what ``load_dataset`` / ``load_from_disk`` returned (a dict of splits or not)."""
    if not hasattr(loaded, "keys"):
        if split is not None:
            raise UserError(f"{source} has no splits: leave out --split")
        return loaded
    splits = list(loaded.keys())
    if split is None:
        if len(splits) != 1:
            raise UserError(f"{source} has splits {splits}: choose one with --split")
        split = splits[0]
    if split not in splits:
        raise UserError(f"{source} has no split {split!r}; splits: {splits}")
    return loaded[split]


def _packaged(name: str) -> Corpus:
    """A corpus shipped in ``bert_cluster/data``; ids are its document titles."""
    if name != "squad-articles":
        raise UserError(f"unknown packaged input {PACKAGE_PREFIX}{name}; packaged: {', '.join(PACKAGED)}")
    import gzip
    import json

    from bert_cluster.datafiles import PACKAGE_DATA, PARAGRAPH_SEPARATOR, join_paragraphs

    path = PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz"
    data = json.loads(gzip.decompress(path.read_bytes()))
    articles = join_paragraphs(data["paragraphs"])
    collector = _Collector(f"{PACKAGE_PREFIX}{name} ({path.name}: {len(articles)} articles)")
    for number, (title, paragraphs) in enumerate(articles.items(), start=1):
        collector.add(title, PARAGRAPH_SEPARATOR.join(paragraphs), number)
    return collector.corpus()


def read_documents(
    source: str | Path,
    text_field: str | None = None,
    id_field: str | None = None,
    json_field: str | None = None,
    split: str | None = None,
) -> Corpus:
    """The documents of ``source`` and the problems met reading it.

    Args:
        source: a text file (any other ending: one document a line, optionally .gz); a .jsonl / .json /
            .csv / .parquet file (optionally .gz); a folder written by ``Dataset.save_to_disk`` or of data
            files; ``package:squad-articles``; or a dataset name on the hub.
        text_field: the column of the texts (default ``text``); not for text files.
        id_field: the column of the ids (default: the line or row number, from 1).
        json_field: for a .json file holding a mapping: the key of its list of records.
        split: the split of a dataset with several.

    Raises:
        UserError: the source does not exist or cannot be read, or a field is not among its columns.
    """
    text = str(source).strip()
    if not text:
        raise UserError("the input is empty: give a file, a folder, a dataset name or package:squad-articles")
    if text.startswith(PACKAGE_PREFIX):
        return _packaged(text[len(PACKAGE_PREFIX) :].strip())
    path = Path(text).expanduser()
    suffix = path.suffix.lower()
    inner = Path(path.stem).suffix.lower() if suffix == ".gz" else suffix
    if path.is_file() and inner not in TABLE_FORMATS:
        if text_field or id_field or json_field:
            raise UserError(
                f"{path} is read as text, one document a line: --text-field, --id-field and "
                "--json-field are for JSONL, JSON, CSV and parquet inputs"
            )
        return read_text_lines(path.resolve())
    if json_field is not None and inner != ".json":
        raise UserError("--json-field is for a .json file holding a mapping of record lists")
    if path.is_file():
        kwargs = {"field": json_field} if json_field else {}
        dataset = _one_split(
            _load_dataset(TABLE_FORMATS[inner], data_files=str(path), **kwargs), str(path), split
        )
        source_name = str(path.resolve())
    elif path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            import datasets

            try:
                loaded = datasets.load_from_disk(str(path))
            except (OSError, ValueError) as error:
                raise UserError(f"cannot read the dataset folder {path}: {one_line(error)}") from None
            dataset = _one_split(loaded, str(path), split)
        else:
            dataset = _one_split(_load_dataset(str(path)), str(path), split)
        source_name = str(path.resolve())
    elif text.startswith((".", "/", "~")) or path.suffix:
        raise UserError(f"input {text} does not exist")
    else:  # a dataset name: the hub (or datasets' cache) when online
        dataset = _one_split(_load_dataset(text), text, split)
        source_name = f"dataset {text}"
    columns = list(dataset.column_names)
    text_field = _check_fields(columns, source_name, text_field, id_field)
    wanted = [text_field] + ([id_field] if id_field and id_field != text_field else [])
    return _rows(dataset.select_columns(wanted), source_name, text_field, id_field)
