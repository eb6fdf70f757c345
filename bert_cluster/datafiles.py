"""Reading data files, the one way the features do: ``datasets.load_dataset`` quietly, the packaged files.

The evaluator's task rows and the embedder's documents both read through ``load_dataset``; both build
SQuAD articles from the packaged paragraphs with ``join_paragraphs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: The files shipped in the package (``bert_cluster/data``).
PACKAGE_DATA = Path(__file__).resolve().parent / "data"
#: Paragraphs of one article are joined with a blank line (whitespace: it adds no token).
PARAGRAPH_SEPARATOR = "\n\n"


def load_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` without its progress bars (the callers show their own progress)."""
    import datasets  # pulls in pandas and pyarrow: only when a file is read

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(*args, **kwargs)
    finally:
        if bars:
            datasets.enable_progress_bars()


def join_paragraphs(paragraphs: Iterable[Mapping[str, str]]) -> dict[str, list[str]]:
    """Each article's paragraphs in order, by title, articles in source order.

    ``paragraphs`` are ``{id, context}`` with ids ``"<article title>/<paragraph number from 0>"`` (the
    packaged ``squad_v1_dev_retrieval.json.gz``); a paragraph repeated with the same text is read once.

    Raises:
        ValueError: a malformed or duplicated paragraph id, or a gap in an article's numbering.
    """
    by_title: dict[str, dict[int, str]] = {}
    for paragraph in paragraphs:
        title, _, number = str(paragraph["id"]).rpartition("/")
        if not title or not number.isdigit():
            raise ValueError(f"paragraph id {paragraph['id']!r} is not '<title>/<number>'")
        numbered = by_title.setdefault(title, {})
        if int(number) in numbered:
            if numbered[int(number)] == paragraph["context"]:
                continue  # the same paragraph again (flat rows repeat it once per question)
            raise ValueError(f"paragraph id {paragraph['id']!r} appears twice")
        numbered[int(number)] = paragraph["context"]
    articles = {}
    for title, numbered in by_title.items():
        numbers = sorted(numbered)
        if numbers != list(range(len(numbers))):
            raise ValueError(f"article {title!r}: paragraphs must be numbered 0..n-1, got {numbers}")
        articles[title] = [numbered[number] for number in numbers]
    return articles
