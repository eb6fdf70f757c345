"""Build the data files of the embedded demo (bert_cluster/data/) from ../shared/data.

Deterministic: the same source files give byte-identical outputs (fixed key order, no timestamp in the
gzip header), so anyone can regenerate them and compare checksums with bert_cluster/data/README.md.

    python -m benchmarks.make_demo_data                # reads ../shared/data, writes bert_cluster/data
    python -m benchmarks.make_demo_data --shared DIR --out DIR --check   # verify instead of writing

Outputs:
    stsb_dev.tsv.gz                  STS-B dev: columns index, genre, sentence1, sentence2, score (1,500 rows)
    squad_v1_dev_retrieval.json.gz   SQuAD v1.1 dev as passage retrieval: 2,067 paragraphs with ids,
                                     10,570 questions with the id of their paragraph (answers dropped)
    STS-B-LICENSE.txt                copy of GLUE's STS-B LICENSE.txt
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import sys
from pathlib import Path

from benchmarks.harness import ROOT

#: sha256 of the source files, as published in ../shared/data/README.md.
SOURCES = {
    "glue/STS-B/dev.tsv": "fe7dc0632a5033562f3cadff991f6e8d9b9b6311861660e78c3c82eb7db67f59",
    "glue/STS-B/LICENSE.txt": "3dfc3217395f8c5dd05c5f8995f25fe2f8fd258e6dd770b3de480749caee8c70",
    "squad/dev-v1.1.json": "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9",
}
STSB_COLUMNS = ("index", "genre", "sentence1", "sentence2", "score")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gzip_bytes(data: bytes) -> bytes:
    """Gzip with mtime 0 and no file name, so the output depends on ``data`` only."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as handle:
        handle.write(data)
    return buffer.getvalue()


def stsb_rows(path: Path) -> bytes:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        rows = [[row[column] for column in STSB_COLUMNS] for row in reader]
    if len(rows) != 1500:
        raise SystemExit(f"expected 1500 STS-B dev rows in {path}, got {len(rows)}")
    # Written by hand rather than with csv.writer: the sentences hold unbalanced quotes that must stay
    # as they are (read back with QUOTE_NONE), and no field holds a tab or a line break (checked).
    lines = ["\t".join(STSB_COLUMNS)]
    for row in rows:
        if any("\t" in field or "\n" in field or "\r" in field for field in row):
            raise SystemExit(f"STS-B row {row[0]} has a tab or line break in a field")
        lines.append("\t".join(row))
    return ("\n".join(lines) + "\n").encode("utf-8")


def squad_retrieval(path: Path) -> bytes:
    source = json.loads(path.read_text(encoding="utf-8"))
    paragraphs, questions = [], []
    for article in source["data"]:
        for number, paragraph in enumerate(article["paragraphs"]):
            paragraph_id = f"{article['title']}/{number}"
            paragraphs.append({"id": paragraph_id, "context": paragraph["context"]})
            for qa in paragraph["qas"]:
                questions.append({"id": qa["id"], "question": qa["question"], "paragraph": paragraph_id})
    if (len(paragraphs), len(questions)) != (2067, 10570):
        raise SystemExit(
            f"expected 2067 paragraphs / 10570 questions, got {len(paragraphs)} / {len(questions)}"
        )
    document = {
        "source": "SQuAD v1.1 dev-v1.1.json (CC BY-SA 4.0), answers dropped",
        "source_sha256": SOURCES["squad/dev-v1.1.json"],
        "paragraphs": paragraphs,
        "questions": questions,
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def build(shared: Path) -> dict[str, bytes]:
    """The output files' names and bytes."""
    for relative, expected in SOURCES.items():
        actual = sha256(shared / relative)
        if actual != expected:
            raise SystemExit(f"{shared / relative}: sha256 {actual} differs from the published {expected}")
    return {
        "stsb_dev.tsv.gz": gzip_bytes(stsb_rows(shared / "glue/STS-B/dev.tsv")),
        "squad_v1_dev_retrieval.json.gz": gzip_bytes(squad_retrieval(shared / "squad/dev-v1.1.json")),
        "STS-B-LICENSE.txt": (shared / "glue/STS-B/LICENSE.txt").read_bytes(),
    }


def _content(data: bytes, name: str) -> bytes:
    return gzip.decompress(data) if name.endswith(".gz") else data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "bert_cluster" / "data")
    parser.add_argument("--check", action="store_true", help="compare with the files in --out, write nothing")
    args = parser.parse_args(argv)

    outputs = build(args.shared)
    mismatched = []
    for name, data in outputs.items():
        target = args.out / name
        digest = hashlib.sha256(data).hexdigest()
        if name.endswith(".gz"):
            digest += f" (content sha256 {hashlib.sha256(gzip.decompress(data)).hexdigest()})"
        if args.check:
            # Compare the content, not the compressed bytes: another zlib may compress differently.
            same = target.is_file() and _content(target.read_bytes(), name) == _content(data, name)
            if not same:
                mismatched.append(name)
            print(f"{'ok  ' if same else 'DIFF'} {name} {len(data)} bytes sha256 {digest}")
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            print(f"wrote {target} {len(data)} bytes sha256 {digest}")
    if mismatched:
        print(
            f"{len(mismatched)} file(s) differ from a fresh build: {', '.join(mismatched)}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
