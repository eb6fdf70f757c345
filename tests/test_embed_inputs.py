"""The embed input readers on hostile files: every record is read or reported at its line, never a traceback.

No model here: ``read_documents`` only. The fuzz tests draw files with hypothesis (random bytes, other
encodings, blank lines, quotes and newlines in CSV cells, nested JSON) and check each record against
the line it was written on.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bert_cluster.embedding import read_documents
from bert_cluster.errors import UserError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _read(path: Path, **fields) -> tuple[list, list] | UserError:
    """The documents and problems, or the UserError; any other exception fails the test."""
    try:
        corpus = read_documents(path, **fields)
    except UserError as error:
        return error
    return corpus.documents, corpus.problems


# --------------------------------------------------------------------------------------------------
# One test per defect of issue 39
# --------------------------------------------------------------------------------------------------


def test_a_folder_of_several_formats_is_refused_naming_them(tmp_path):
    import datasets

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("one\ntwo\n", encoding="utf-8")
    (folder / "b.jsonl").write_text('{"text": "three"}\n', encoding="utf-8")
    (folder / "c.csv").write_text("text\nfour\n", encoding="utf-8")
    datasets.Dataset.from_list([{"text": "five"}]).to_parquet(str(folder / "d.parquet"))
    with pytest.raises(
        UserError, match=r"holds files of 4 formats \(text: a.txt; json: b.jsonl; csv: c.csv; "
    ):
        read_documents(folder)
    # One format (hidden files and a dataset card aside) is read whole.
    (tmp_path / "one").mkdir()
    for name in ("x", "y"):
        datasets.Dataset.from_list([{"text": f"{name} text"}]).to_parquet(
            str(tmp_path / "one" / f"{name}.parquet")
        )
    (tmp_path / "one" / "README.md").write_text("# card", encoding="utf-8")
    (tmp_path / "one" / ".hidden").write_text("not data", encoding="utf-8")
    assert sorted(d.text for d in read_documents(tmp_path / "one").documents) == ["x text", "y text"]


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("e.jsonl", b""),
        ("blank.jsonl", b"\n  \n"),
        ("e.txt", b""),
        ("e.csv", b""),
        ("header.csv", b"text\n"),
        ("e.json", b""),
        ("list.json", b"[]"),
        ("e.parquet", None),
    ],
)
def test_an_empty_input_says_no_documents(tmp_path, name, content):
    if content is None:
        import datasets

        datasets.Dataset.from_dict({"text": []}).to_parquet(str(tmp_path / name))
    else:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=r"no documents") as raised:
        read_documents(tmp_path / name)
    assert str(tmp_path / name) in str(raised.value)


def test_jsonl_lines_are_the_editors_after_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": ""}\n   \n{"text": "b"}\n', encoding="utf-8")
    read = read_documents(path)
    assert [(d.id, d.text, d.line) for d in read.documents] == [("1", "a", 1), ("3", "b", 5)]
    assert [(p.id, p.line, p.reason) for p in read.problems] == [("2", 3, "empty")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "a"}\n\n{"text": \n', r"line 3: not valid JSON \(Expecting value at column 10\)"),
        (b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"line 2: not valid UTF-8 \(byte 14 of the line\)"),
        (b'{"text": "a"}\n["text"]\n', r"line 2: a JSON object is expected, got an array"),
    ],
)
def test_a_malformed_jsonl_line_is_refused_with_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=f"^{path} {message}$"):
        read_documents(path)


def test_csv_cells_are_text(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('id,text\n007,NA\n008,null\n009,None\n010,""\n011,"two\nlines"\n', encoding="utf-8")
    read = read_documents(path, id_field="id")
    assert [(d.id, d.text, d.line) for d in read.documents] == [
        ("007", "NA", 2),
        ("008", "null", 3),
        ("009", "None", 4),
        ("011", "two\nlines", 6),
    ]
    assert [(p.id, p.line, p.reason) for p in read.problems] == [("010", 5, "empty")]


def test_a_malformed_csv_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('text,id\na,1\n\n"b",2,extra\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"line 4: 3 cells where the header has 2"):
        read_documents(path)
    path.write_text('text\na\n"unclosed\nb\n', encoding="utf-8")  # the quote opens on line 3 (issue 69)
    with pytest.raises(
        UserError, match=r"line 3: not valid CSV \(a quote in the record starting on this line"
    ):
        read_documents(path)
    path.write_bytes(b"text\na\nb\rc\n")  # a bare CR in an unquoted cell
    with pytest.raises(UserError, match=r"line 3: not valid CSV \(new-line character seen in unquoted field"):
        read_documents(path)


# --------------------------------------------------------------------------------------------------
# Fuzz: every record read or reported at its line; only UserError ever leaves the reader
# --------------------------------------------------------------------------------------------------

#: Texts as users write them, and the ones that trip parsers: NA words, quotes, commas, newlines, CRs.
TEXTS = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        ["", " ", "\t", "NA", "null", "None", "nan", "N/A", '"', '""', ",", "a,b", "x\ny", "x\r\ny"]
    ),
    st.text(alphabet=st.sampled_from('ab ,"\n\r\t'), max_size=12),
)


def _start_lines(chunks: list[bytes]) -> list[int]:
    """The 1-based line each chunk starts on, the chunks written one after another."""
    starts, line = [], 1
    for chunk in chunks:
        starts.append(line)
        line += chunk.count(b"\n")
    return starts


def _good(text: object) -> bool:
    return isinstance(text, str) and text.strip() != ""


def _expect_read(read, records: list[tuple[int, object]]) -> None:
    """Each record (line, text) is one document with that text, or one problem saying why, by row id.

    An input with no good record is refused, naming its first problem's line (issue 69: a text file of
    blank lines was "0 documents" and exit 0, a JSONL file of them refused).
    """
    if not any(_good(text) for _, text in records):
        assert isinstance(read, UserError), read
        assert f"no documents to embed: every one of its {len(records)} record(s) is a problem " in str(read)
        assert f"(line {records[0][0]}: " in str(read)
        return
    assert not isinstance(read, UserError), read
    documents, problems = read
    by_line = {d.line: d for d in documents}
    reported = {p.line: p for p in problems}
    assert len(by_line) == len(documents) and len(reported) == len(problems)
    assert set(by_line).isdisjoint(reported)
    assert sorted([*by_line, *reported]) == [line for line, _ in records]
    for row, (line, text) in enumerate(records, start=1):
        if _good(text):
            assert by_line[line].text == text and by_line[line].id == str(row)
        else:
            assert reported[line].id == str(row)
            if text is None:
                expected = "no text (missing or null)"
            elif isinstance(text, str):
                expected = "whitespace only" if text else "empty"
            else:
                expected = "not a string"
            assert expected in reported[line].reason


@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            st.text(max_size=20).filter(lambda t: "\n" not in t and not t.endswith("\r")).map(str.encode),
            st.binary(max_size=12).filter(lambda b: b"\n" not in b and not b.endswith(b"\r")),
            st.sampled_from([b"", b"  ", b"\t"]),
        ),
        max_size=12,
    ),
    final_newline=st.booleans(),
    crlf=st.booleans(),
)
def test_fuzz_text_files(tmp_path, lines, final_newline, crlf):
    path = tmp_path / "fuzz.txt"
    ending = b"\r\n" if crlf else b"\n"
    data = ending.join(lines) + (ending if final_newline and lines else b"")
    path.write_bytes(data)
    read = _read(path)
    kept = lines[:-1] if lines and lines[-1] == b"" and not final_newline else lines
    if not kept:
        assert isinstance(read, UserError) and "no documents" in str(read)
        return
    texts = {}
    for number, raw in enumerate(kept, start=1):
        raw = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw
        try:
            texts[number] = raw.decode("utf-8")
        except UnicodeDecodeError:
            texts[number] = None
    if not any(_good(text) for text in texts.values()):  # nothing to embed: refused (issue 69)
        assert isinstance(read, UserError) and "no documents to embed" in str(read), read
        assert f"(line 1: {'empty' if kept[0] == b'' else ''}" in str(read)
        return
    assert not isinstance(read, UserError), read
    documents, problems = read
    assert sorted([d.line for d in documents] + [p.line for p in problems]) == list(range(1, len(kept) + 1))
    for document in documents:
        assert document.text == texts[document.line] and document.id == str(document.line)
    for problem in problems:  # undecodable, empty or blank: nothing else is skipped
        assert texts[problem.line] is None or not texts[problem.line].strip(), problem


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXTS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
JSONL_LINES = st.one_of(
    st.builds(lambda text, meta: {"text": text, "meta": meta}, TEXTS, JSON_VALUES),  # nested JSON beside
    st.builds(lambda value: {"text": value}, JSON_VALUES),  # any value as the text
    st.just({"other": 1}),  # no text at all
    st.sampled_from(["", "   ", "\t"]),  # blank lines
    st.binary(max_size=10).filter(lambda b: b"\n" not in b),  # anything
)


@FUZZ
@given(entries=st.lists(JSONL_LINES, max_size=10), ascii_only=st.booleans())
def test_fuzz_jsonl(tmp_path, entries, ascii_only):
    raws = [
        json.dumps(e, ensure_ascii=ascii_only).encode()
        if isinstance(e, dict)
        else e
        if isinstance(e, bytes)
        else e.encode()
        for e in entries
    ]
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"".join(raw + b"\n" for raw in raws))
    read = _read(path)
    records, bad = [], None
    for line, raw in enumerate(raws, start=1):
        raw = raw.removeprefix(b"\xef\xbb\xbf") if line == 1 else raw
        if not raw.strip():
            continue
        try:
            value = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            bad = bad or line
        if bad is None:
            records.append((line, value))
    if bad is not None:
        assert isinstance(read, UserError) and f"{path} line {bad}: " in str(read), read
    elif not records:
        assert isinstance(read, UserError) and "no documents" in str(read)
    elif not any("text" in value for _, value in records):
        assert isinstance(read, UserError) and "give --text-field" in str(read)
    else:
        _expect_read(read, [(line, value.get("text")) for line, value in records])


@FUZZ
@given(
    rows=st.lists(st.tuples(TEXTS, st.integers(0, 2)), min_size=1, max_size=8),
    terminator=st.sampled_from(["\n", "\r\n"]),
    encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "latin-1"]),
)
def test_fuzz_csv(tmp_path, rows, terminator, encoding):
    """Rows written by csv.writer (quotes, commas, newlines in cells), blank lines between some."""
    written = ""
    starts = []
    for row, (text, blanks) in enumerate([("text", 0), *rows]):
        starts.append(written.count("\n") + 1)
        buffer = io.StringIO()
        # A CRLF terminator makes the writer quote a cell holding a CR (a bare CR is no valid CSV cell).
        csv.writer(buffer, lineterminator="\r\n").writerow([text, "x" if row else "other"])
        written += buffer.getvalue().removesuffix("\r\n") + terminator + "\n" * blanks
    starts = starts[1:]
    data = written.encode(encoding, "replace")
    path = tmp_path / "fuzz.csv"
    path.write_bytes(data)
    read = _read(path)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        assert isinstance(read, UserError) and f"{path} line {line}: not valid UTF-8" in str(read), read
        return
    # What the bytes say in UTF-8 (a latin-1 file of ASCII and replaced characters decodes as itself).
    texts = [text.encode(encoding.removesuffix("-sig"), "replace").decode("utf-8") for text, _ in rows]
    _expect_read(read, list(zip(starts, texts, strict=True)))


@FUZZ
@given(data=st.binary(max_size=200), ending=st.sampled_from([".txt", ".jsonl", ".csv"]))
def test_fuzz_random_bytes_never_raise_anything_but_a_user_error(tmp_path, data, ending):
    path = tmp_path / f"random{ending}"
    path.write_bytes(data)
    read = _read(path)
    if not isinstance(read, UserError):
        documents, problems = read
        lines = data.count(b"\n") + 1
        assert all(1 <= item.line <= lines for item in [*documents, *problems])


# --------------------------------------------------------------------------------------------------
# One test per defect of issue 69 (the readers' part)
# --------------------------------------------------------------------------------------------------


def test_a_lone_surrogate_is_a_problem_of_the_first_pass_named_by_its_line(tmp_path):
    """A JSON escape can hold a lone surrogate, which no tokenizer takes: it was accepted by the first
    pass and failed the second with a tokenizer TypeError, naming no line."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "\\ud800 x"}\n{"text": "a \\udfff"}\n{"text": "ok"}\n')
    read = read_documents(path)
    assert [(d.id, d.line) for d in read.documents] == [("1", 1), ("4", 4)]
    assert [(p.id, p.line, p.reason) for p in read.problems] == [
        ("2", 2, "not valid Unicode: a lone surrogate U+D800 at character 1, which no tokenizer takes"),
        ("3", 3, "not valid Unicode: a lone surrogate U+DFFF at character 3, which no tokenizer takes"),
    ]
    from bert_cluster.embedding import open_documents

    scan = open_documents(path).scan()  # the pass a run makes before any work
    assert [p.line for p in scan.problems] == [2, 3] and scan.documents == 2


def _write_records(path: Path, records: list[dict]) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    elif path.suffix == ".csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["id", "text"])
        writer.writerows([[record.get("id") or "", record["text"]] for record in records])
        path.write_text(buffer.getvalue(), encoding="utf-8")
    else:
        import datasets

        rows = {"id": [record.get("id") for record in records], "text": [r["text"] for r in records]}
        datasets.Dataset.from_dict(rows).to_parquet(str(path))


@pytest.mark.parametrize("ending", [".jsonl", ".csv", ".parquet"])
@pytest.mark.parametrize("missing", [None, ""], ids=["null", "empty"])
def test_a_record_without_an_id_never_takes_a_later_records_id(tmp_path, ending, missing):
    """Issue 69: with --id-field, a record without an id took its row number "1", and the user's real
    "1" that came later was dropped as a repeat; an empty id was an id in JSONL but none in CSV."""
    path = tmp_path / f"d{ending}"
    _write_records(path, [{"id": missing, "text": "no id"}, {"id": "1", "text": "the real one"}])
    read = read_documents(path, id_field="id")
    assert [(d.id, d.text) for d in read.documents] == [("1", "the real one")]
    ((problem),) = read.problems
    assert (problem.id, problem.line) == ("", 2 if ending == ".csv" else 1)
    assert problem.reason == "no id (the id field is missing, null or empty)"


@pytest.mark.parametrize(
    ("name", "content", "first"),
    [
        ("blank.txt", b"\n\n  \n", "line 1: empty"),
        ("empty-texts.jsonl", b'{"text": ""}\n{"text": " "}\n', "line 1: empty"),
        ("empty-cells.csv", b'text\n""\n" "\n', "line 2: empty"),
    ],
)
def test_an_input_with_nothing_to_embed_is_refused_in_every_format(tmp_path, name, content, first):
    """Issue 69: a text file of blank lines embedded "0 documents" with exit 0, a JSONL file of blank
    lines was refused."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(
        UserError, match=r"no documents to embed: every one of its \d record\(s\) is a problem"
    ) as e:
        read_documents(tmp_path / name)
    assert f"({first}; ...)" in str(e.value) and str(tmp_path / name) in str(e.value)
