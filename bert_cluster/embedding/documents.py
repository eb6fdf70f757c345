"""Reading an embed input into documents, with every document that cannot be embedded recorded.

Plain text, JSONL and CSV files are read here, as bytes, so that every problem is reported with its line
as an editor counts it (1-based; ``datasets`` skips blank lines and names no line): a text file holds
one document a line, a JSONL file one JSON object a line (blank lines allowed), a CSV file a header and
one record a row (quoted cells may hold newlines; every cell is text, ``NA`` and ``null`` included).
JSON and parquet files, ``datasets`` folders (``save_to_disk``), folders of data files of one format and
dataset names (the hub, when online) go through ``datasets``. ``package:squad-articles`` names the 48
SQuAD v1.1 dev articles shipped in ``bert_cluster/data`` (the long documents of the demo).
Empty, whitespace-only, undecodable or non-string texts, texts no tokenizer takes (a lone surrogate,
which a JSON escape can hold), records without an id where ids are asked for (a missing, null or empty
id, in every format) and repeated ids become ``Problem`` records: never dropped silently, never
embedded. A JSONL or CSV file that is malformed (a line that is not UTF-8 or not a JSON object, a row
with more cells than the header) is refused, naming its file and line; an input without a single
record, or without a single record to embed, is refused too ("no documents").

The first pass (``Input.scan``) records the content hash of the input after each shard's last document
and a hash of each shard's ids; the second (``Input.documents``) checks the first at each shard's end
and at the input's end, so an input changed between the passes is refused before a shard of other
documents is written, and a resume checks the second against the shards on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bert_cluster.embedding.plan import ids_sha256
from bert_cluster.errors import UserError, one_line

#: File endings read as tables (with or without .gz): JSONL and CSV here, the others through
#: ``datasets.load_dataset(<builder>, data_files=...)``.
TABLE_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".parquet": "parquet"}
#: Read here, line by line, so that a problem names its line.
LINE_FORMATS = (".jsonl", ".ndjson", ".csv")
#: A folder's data files by format (how datasets groups them); any other ending is a format of its own.
FOLDER_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
#: The packaged corpora an input may name (``package:NAME``).
PACKAGED = ("squad-articles",)
PACKAGE_PREFIX = "package:"


@dataclasses.dataclass(frozen=True)
class Document:
    """One text to embed; ``line``: where it starts in a text, JSONL or CSV file, else its row (from 1)."""

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


@dataclasses.dataclass(frozen=True)
class ShardSpan:
    """What the first pass read of one shard's documents: the second pass and a resume check against it."""

    first_id: str
    last_id: str
    #: ``plan.ids_sha256`` of the shard's ids, in order: which documents a shard file must hold.
    ids_sha256: str
    #: The input's content hash (``Corpus.fingerprint`` so far) right after the shard's last document.
    content_sha256: str


@dataclasses.dataclass
class Scan:
    """What a pass over an input finds without keeping its documents: enough to plan and check a run."""

    source: str
    #: How many documents will be embedded (the records that are no problem).
    documents: int
    problems: list[Problem]
    #: ``Corpus.fingerprint`` of the same input.
    fingerprint: str
    #: Documents per shard the spans were taken for (None: no spans).
    shard_size: int | None = None
    #: One per shard of ``shard_size`` documents, in order.
    spans: list[ShardSpan] = dataclasses.field(default_factory=list)


class InputChanged(UserError):
    """The second pass over an input read other content than the first (the file changed meanwhile)."""


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
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate (a JSON escape such as \ud800)
        return (
            f"not valid Unicode: a lone surrogate U+{ord(text[error.start]):04X} at character "
            f"{error.start + 1}, which no tokenizer takes"
        )
    return None


class _Classifier:
    """Each record as a ``Document`` or a ``Problem``, with repeated ids caught and the content hashed.

    ``unique_ids``: every id is a line or row number (no id field), so none can repeat and none is kept;
    otherwise every id seen is kept (the one thing a pass keeps per document).
    """

    def __init__(self, unique_ids: bool = False) -> None:
        self.unique_ids = unique_ids
        self.first_line: dict[str, int] = {}
        self.digest = hashlib.sha256()

    def record(self, identifier: Any, text: Any, line: int, row: int | None = None) -> Document | Problem:
        """One record; its id is ``row`` (its number among the records), else ``line``, where no id field is.

        Where ids are asked for, a record without one (missing, null or empty) is a problem: a number
        given in its place could be an id that a later record holds.
        """
        reason = _text_problem(text)
        if identifier is None or identifier == "":
            if self.unique_ids:
                identifier = str(line if row is None else row)
            else:
                identifier = ""
                reason = reason or "no id (the id field is missing, null or empty)"
        else:
            identifier = str(identifier)
        if reason is None and identifier in self.first_line:
            reason = f"repeated id (first at line {self.first_line[identifier]})"
        if reason is not None:
            self.digest.update(f"P\0{identifier}\0{line}\0{reason}\0".encode())
            return Problem(identifier, line, reason)
        if not self.unique_ids:
            self.first_line[identifier] = line
        self.digest.update(f"D\0{identifier}\0{line}\0".encode())
        self.digest.update(text.encode("utf-8", "surrogatepass"))
        return Document(identifier, text, line)

    def undecodable(self, number: int, raw: bytes, start: int) -> Problem:
        """A line of a text file that is not UTF-8 (``start``: the first bad byte, from 0)."""
        self.digest.update(f"P\0{number}\0undecodable\0".encode() + raw)
        return Problem(str(number), number, f"not valid UTF-8 (byte {start + 1} of the line)")


#: A reader: given a classifier, every record of the input in order, as a document or a problem.
Records = Callable[[_Classifier], Iterator[Document | Problem]]


class Input:
    """An input that is read as a stream, as often as needed, never held whole.

    ``scan`` reads it once to its end (the fingerprint, the counts, the problems, and every refusal of a
    malformed input), keeping no document; ``documents`` then yields its documents in order, one at a
    time. Both classify the records the same way, so ``documents`` yields ``scan().documents`` of them,
    and after a scan it checks that it does (``InputChanged`` otherwise).
    """

    def __init__(self, source: str, records: Records, unique_ids: bool) -> None:
        self.source = source
        self._records = records
        self._unique_ids = unique_ids
        self._scanned: Scan | None = None

    def _items(self, classifier: _Classifier) -> Iterator[Document | Problem]:
        return self._records(classifier)

    def scan(self, shard_size: int | None = None) -> Scan:
        """One pass to the end, holding no document; with ``shard_size``, each shard's ``ShardSpan`` too.

        Raises:
            UserError: the input is malformed (file and line named), a field is not a column, or it holds
                no document to embed.
        """
        classifier = _Classifier(self._unique_ids)
        documents, problems, spans = 0, [], []
        ids: list[str] = []  # of the shard being read
        for item in self._items(classifier):
            if not isinstance(item, Document):
                problems.append(item)
                continue
            documents += 1
            if shard_size is not None:
                ids.append(item.id)
                after = classifier.digest.copy()  # the problems after the last document are no shard's
                if len(ids) == shard_size:
                    spans.append(_span(ids, after))
                    ids = []
        if ids:
            spans.append(_span(ids, after))
        _refuse_nothing_to_embed(self.source, documents, problems)
        self._scanned = Scan(
            self.source, documents, problems, classifier.digest.hexdigest(), shard_size, spans
        )
        return self._scanned

    def documents(self) -> Iterator[Document]:
        """The documents, in input order, read as they are asked for (problems are left out).

        After ``scan``, the content read is checked against the scan's at each shard's last document
        (before it is yielded) and at the end.

        Raises:
            InputChanged: the input's content differs from what ``scan`` read.
        """
        expected = self._scanned
        size = expected.shard_size if expected is not None else None
        classifier = _Classifier(self._unique_ids)
        count = 0
        for item in self._items(classifier):
            if not isinstance(item, Document):
                continue
            count += 1
            if expected is not None and size:
                index = (count - 1) // size
                if index >= len(expected.spans):  # more documents than the first pass read
                    raise self._changed(count)
                ends_shard = count % size == 0 or count == expected.documents
                if ends_shard and classifier.digest.hexdigest() != expected.spans[index].content_sha256:
                    raise self._changed(count)
            yield item
        if expected is not None and classifier.digest.hexdigest() != expected.fingerprint:
            raise self._changed(count)

    def _changed(self, count: int) -> InputChanged:
        return InputChanged(
            f"{self.source} changed while it was read: what its second pass read up to document {count} "
            "differs from its first pass's (content sha256)"
        )

    def corpus(self) -> Corpus:
        """Every document in memory, with the problems and the fingerprint (small inputs, tests)."""
        classifier = _Classifier(self._unique_ids)
        documents, problems = [], []
        for item in self._items(classifier):
            (documents if isinstance(item, Document) else problems).append(item)
        _refuse_nothing_to_embed(self.source, len(documents), problems)
        return Corpus(documents, problems, self.source, classifier.digest.hexdigest())


def _span(ids: list[str], content: Any) -> ShardSpan:
    return ShardSpan(ids[0], ids[-1], ids_sha256(ids), content.hexdigest())


def _refuse_nothing_to_embed(source: str, documents: int, problems: list[Problem]) -> None:
    """An input without a record, or whose every record is a problem, is refused: there is nothing to do."""
    if documents:
        return
    if not problems:
        raise UserError(f"{source}: no documents (the input holds no record)")
    first = problems[0]
    raise UserError(
        f"{source}: no documents to embed: every one of its {len(problems)} record(s) is a problem "
        f"(line {first.line}: {first.reason}{'; ...' if len(problems) > 1 else ''})"
    )


def _file_lines(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes, each with its LF when it has one, read as they are asked for (.gz too)."""
    try:
        if path.suffix.lower() == ".gz":
            import gzip

            handle: Any = gzip.open(path, "rb")  # noqa: SIM115 - closed below, also when a reader stops early
        else:
            handle = open(path, "rb")  # noqa: SIM115
        with handle:
            first = True
            for line in handle:
                if first:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark is not text
                    first = False
                yield line
    except (OSError, EOFError) as error:
        raise UserError(f"cannot read {path}: {one_line(error)}") from None


def _raw_lines(path: Path) -> Iterator[bytes]:
    """The file's lines (LF or CRLF, the ending removed; a final newline ends the last line), no BOM."""
    for line in _file_lines(path):
        yield line.removesuffix(b"\n").removesuffix(b"\r")


def _decoded(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{path} line {number}: not valid UTF-8 (byte {error.start + 1} of the line)"
        ) from None


def _text_records(path: Path) -> Records:
    def records(classifier: _Classifier) -> Iterator[Document | Problem]:
        for number, raw in enumerate(_raw_lines(path), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield classifier.undecodable(number, raw, error.start)
                continue
            yield classifier.record(None, text, number)

    return records


def _jsonl_records(path: Path, text_field: str | None, id_field: str | None) -> Records:
    """One JSON object a line; blank lines are skipped but counted, so ``line`` is the editor's line.

    The fields are checked against every object's keys at the end (a field may appear late).
    """
    import json

    def records(classifier: _Classifier) -> Iterator[Document | Problem]:
        text_name = text_field or "text"
        columns: dict[str, None] = {}
        row = 0
        for number, raw in enumerate(_raw_lines(path), start=1):
            if not raw.strip():
                continue
            line = _decoded(path, number, raw)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(
                    f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno})"
                ) from None
            except RecursionError:
                raise UserError(f"{path} line {number}: JSON nested too deeply") from None
            if not isinstance(record, dict):
                raise UserError(f"{path} line {number}: a JSON object is expected, got {_json_type(record)}")
            columns.update(dict.fromkeys(record))
            row += 1
            identifier = record.get(id_field) if id_field else None
            yield classifier.record(identifier, record.get(text_name), number, row)
        if not row:
            raise UserError(f"{path}: no documents (no JSON object in the file)")
        _check_fields(list(columns), str(path), text_field, id_field)

    return records


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _csv_records(path: Path, text_field: str | None, id_field: str | None) -> Records:
    """A header, then one record a row; the fields are checked at the end (after any malformed row)."""
    import csv
    import sys

    def records(classifier: _Classifier) -> Iterator[Document | Problem]:
        # Lines keep their endings: a CR inside a quoted cell is the cell's (the parser drops a row's CRLF).
        ended = []  # set once the parser has read the last line

        def decoded() -> Iterator[str]:  # lazily: an undecodable line is named when the parser reaches it
            for number, raw in enumerate(_file_lines(path), start=1):
                yield _decoded(path, number, raw)
            ended.append(True)

        reader = csv.reader(decoded(), strict=True)
        header: list[str] | None = None
        text_index = id_index = None
        fields_error: UserError | None = None
        row = 0
        while True:
            start = reader.line_num + 1
            limit = csv.field_size_limit(sys.maxsize)  # a whole document in one cell
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error as error:
                if ended:  # the file ended inside a quoted cell: name the record's first line, not the last
                    raise UserError(
                        f"{path} line {start}: not valid CSV (a quote in the record starting on this line is "
                        "never closed)"
                    ) from None
                raise UserError(f"{path} line {reader.line_num}: not valid CSV ({error})") from None
            finally:
                csv.field_size_limit(limit)
            if not cells:
                continue  # a blank line
            if header is None:
                header = cells
                repeated = sorted({name for name in cells if cells.count(name) > 1})
                if repeated:
                    raise UserError(f"{path} line {start}: column(s) {repeated} appear twice in the header")
                try:  # raised at the end: a malformed row, or no record at all, is reported first
                    name = _check_fields(header, str(path), text_field, id_field)
                    text_index = header.index(name)
                    id_index = header.index(id_field) if id_field else None
                except UserError as error:
                    fields_error = error
                continue
            if len(cells) > len(header):
                raise UserError(f"{path} line {start}: {len(cells)} cells where the header has {len(header)}")
            row += 1
            if fields_error is not None or text_index is None:
                continue
            text = cells[text_index] if text_index < len(cells) else None
            identifier = None
            if id_index is not None and id_index < len(cells):
                identifier = cells[id_index] or None
            yield classifier.record(identifier, text, start, row)
        if header is None or not row:
            raise UserError(f"{path}: no documents (no record under a header)")
        if fields_error is not None:
            raise fields_error

    return records


def _dataset_records(dataset: Any, text_field: str, id_field: str | None) -> Records:
    def records(classifier: _Classifier) -> Iterator[Document | Problem]:
        number = 0
        for batch in dataset.iter(batch_size=4096):  # columns at a time: much faster than row dicts
            ids = batch[id_field] if id_field else [None] * len(batch[text_field])
            for identifier, text in zip(ids, batch[text_field], strict=True):
                number += 1
                yield classifier.record(identifier, text, number)

    return records


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
    """``datasets.load_dataset`` quietly, with its failures as one-line ``UserError``s naming the input."""
    from bert_cluster.datafiles import load_dataset as load

    source = kwargs.get("data_files") or (args[0] if args else "the input")
    try:
        return load(*args, **kwargs)
    except Exception as error:  # datasets' own errors (DatasetGenerationError, ...) derive from Exception
        # datasets has no error type of its own for an input without a record: a bare StopIteration (an
        # empty JSON file) or a ValueError saying the split "corresponds to no data".
        if isinstance(error, StopIteration) or "corresponds to no data" in str(error):
            raise UserError(f"{source}: no documents (no record in it)") from None
        if isinstance(error, (OSError, ValueError, KeyError, TypeError)):
            raise UserError(f"cannot read {source}: {one_line(error)}") from None
        raise UserError(f"cannot read {source}: {type(error).__name__}: {one_line(error)}") from None


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


def _packaged(name: str) -> Input:
    """A corpus shipped in ``bert_cluster/data``; ids are its document titles."""
    if name != "squad-articles":
        raise UserError(f"unknown packaged input {PACKAGE_PREFIX}{name}; packaged: {', '.join(PACKAGED)}")
    import gzip
    import json

    from bert_cluster.datafiles import PACKAGE_DATA, PARAGRAPH_SEPARATOR, join_paragraphs

    path = PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz"
    data = json.loads(gzip.decompress(path.read_bytes()))
    articles = join_paragraphs(data["paragraphs"])

    def records(classifier: _Classifier) -> Iterator[Document | Problem]:
        for number, (title, paragraphs) in enumerate(articles.items(), start=1):
            yield classifier.record(title, PARAGRAPH_SEPARATOR.join(paragraphs), number)

    return Input(f"{PACKAGE_PREFIX}{name} ({path.name}: {len(articles)} articles)", records, unique_ids=False)


def _format(path: Path) -> str:
    """The format of a data file in a folder, by its ending (a compression ending looked through)."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    ending = suffixes[-1] if suffixes else "(no ending)"
    return FOLDER_FORMATS.get(ending, ending)


def _check_one_format(folder: Path) -> None:
    """Refuse a folder of data files of several formats: ``datasets`` would read one and skip the rest.

    Hidden files and folders and a README.md (a dataset card) are not data.
    """
    found: dict[str, list[str]] = {}
    for file in sorted(folder.rglob("*")):
        relative = file.relative_to(folder)
        if not file.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if relative.name.lower() == "readme.md":
            continue
        found.setdefault(_format(file), []).append(str(relative))
    if len(found) > 1:
        listed = "; ".join(
            f"{name}: {', '.join(files[:2])}{', ...' if len(files) > 2 else ''}"
            for name, files in found.items()
        )
        raise UserError(
            f"{folder} holds files of {len(found)} formats ({listed}), and a folder is read as one format: "
            "give the files one at a time, or a folder of one format"
        )


def read_documents(
    source: str | Path,
    text_field: str | None = None,
    id_field: str | None = None,
    json_field: str | None = None,
    split: str | None = None,
) -> Corpus:
    """The documents of ``source`` and the problems met reading it, all in memory (``open_documents``).

    Same arguments and errors as ``open_documents``.
    """
    return open_documents(source, text_field, id_field, json_field, split).corpus()


def open_documents(
    source: str | Path,
    text_field: str | None = None,
    id_field: str | None = None,
    json_field: str | None = None,
    split: str | None = None,
) -> Input:
    """``source`` as an ``Input``, read as a stream; only what naming it requires is checked here.

    A file is read line by line on each pass; ``datasets`` inputs are loaded here (memory-mapped Arrow).

    Args:
        source: a text file (any other ending: one document a line, optionally .gz); a .jsonl / .json /
            .csv / .parquet file (optionally .gz); a folder written by ``Dataset.save_to_disk`` or of data
            files; ``package:squad-articles``; or a dataset name on the hub.
        text_field: the column of the texts (default ``text``); not for text files.
        id_field: the column of the ids (default: the line or row number, from 1).
        json_field: for a .json file holding a mapping: the key of its list of records.
        split: the split of a dataset with several.

    Raises:
        UserError: the source does not exist, cannot be read, is a folder of several formats, or (for
            ``datasets`` inputs) a field is not among its columns. A malformed file (file and line named),
            a field not among a JSONL or CSV file's columns and an input without a record are refused by
            the first pass over it (``Input.scan``, or ``corpus``), before any document is used.
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
        return Input(str(path.resolve()), _text_records(path.resolve()), unique_ids=True)
    if json_field is not None and inner != ".json":
        raise UserError("--json-field is for a .json file holding a mapping of record lists")
    if path.is_file() and inner in LINE_FORMATS:
        if split is not None:
            raise UserError(f"{path} has no splits: leave out --split")
        reader = _csv_records if inner == ".csv" else _jsonl_records
        return Input(str(path.resolve()), reader(path.resolve(), text_field, id_field), id_field is None)
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
            _check_one_format(path)
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
    records = _dataset_records(dataset.select_columns(wanted), text_field, id_field)
    return Input(source_name, records, unique_ids=id_field is None)
