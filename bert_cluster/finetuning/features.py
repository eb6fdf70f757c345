"""A task's training rows as the features a transformers head computes its own loss from.

One function per ``train.loss`` of the task configs: ``cross-entropy`` (class indices in the model's
label order), ``mse`` (a float score) and ``span-cross-entropy`` (SQuAD: windows of the context with the
answer's start and end token, or the ``[CLS]`` token where the window does not hold the answer, as
BERT's SQuAD recipe does). ``check_rows`` refuses, before any training, a row whose text or label the
loss cannot take, naming its file and line (``locator``) and what is allowed.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bert_cluster.errors import UserError
from bert_cluster.evaluation.tasks import LocalFile, TaskConfig, label_index

#: Where a row (its index among the rows read, and the row) came from, for a message: file and line.
Locator = Callable[[int, dict[str, Any]], str]


def locator(task: TaskConfig, data_dir: Any, source: str, count: int) -> Locator:
    """Where each of the ``count`` train rows ``load_rows`` read from ``source`` is, for messages.

    A line of a TSV/CSV file, a question id of a SQuAD file, else a row number (from 1).
    """
    from bert_cluster.evaluation.data import data_dirs, find_local

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


def _check_text(value: Any, field: str) -> None:
    if value is None:
        raise UserError(f"no {field} (missing or null): every row needs its text")
    if not isinstance(value, str):
        raise UserError(f"{field} is a {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate (a JSON escape): no tokenizer takes it
        raise UserError(
            f"{field} is not valid Unicode: a lone surrogate U+{ord(value[error.start]):04X} at character "
            f"{error.start + 1}, which no tokenizer takes"
        ) from None


def _check_answers(answers: Any) -> None:
    texts = answers.get("text") if isinstance(answers, dict) else None
    starts = answers.get("answer_start") if isinstance(answers, dict) else None
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        raise UserError("answers must hold lists 'text' and 'answer_start' of one length")
    if not all(isinstance(text, str) for text in texts):
        raise UserError("every answer text must be a string")
    if not all(isinstance(at, int) and not isinstance(at, bool) and at >= 0 for at in starts):
        raise UserError(f"every answer_start must be a non-negative int, got {starts!r}")


def check_rows(rows: Sequence[dict[str, Any]], task: TaskConfig, where: Locator) -> None:
    """Refuse, before any training, a row whose texts or label the task's loss cannot take.

    Raises:
        UserError: naming the row's file and line (``where``), the field and what is allowed.
    """
    spans = task.train.loss == "span-cross-entropy"
    fields = ("question", "context") if spans else task.text_fields
    for index, row in enumerate(rows):
        try:
            for field in fields:
                _check_text(row.get(field), field)
            if spans:
                _check_answers(row.get("answers"))
            else:
                label_index(row.get(task.label_field), task)
        except UserError as error:
            raise UserError(f"{where(index, row)}: {error}") from None


def classification(
    rows: Sequence[dict[str, Any]],
    task: TaskConfig,
    tokenizer: Any,
    max_length: int,
    to_model: Sequence[int] | None,
) -> list[dict[str, Any]]:
    """Tokenized texts with ``labels``; ``to_model[i]``: the model's output index of dataset label i."""
    columns = [[str(row[field]) for row in rows] for field in task.text_fields]
    encoded = tokenizer(*columns, truncation=True, max_length=max_length)
    features = []
    for index, row in enumerate(rows):
        label = label_index(row[task.label_field], task)
        if task.label_names is not None and to_model is not None:
            label = to_model[label]
        features.append({**{name: encoded[name][index] for name in encoded}, "labels": label})
    return features


def spans(
    rows: Sequence[dict[str, Any]], task: TaskConfig, tokenizer: Any, max_length: int
) -> list[dict[str, Any]]:
    """SQuAD windows (the task's ``doc_stride``) with ``start_positions`` / ``end_positions``.

    A question without an answer (SQuAD v2) and a window that cuts the answer point at ``[CLS]``.
    """
    stride = int(task.options.get("doc_stride", 128))
    questions = [str(row["question"]).lstrip() for row in rows]
    contexts = [str(row["context"]) for row in rows]
    if max_length <= stride + 8:
        raise UserError(f"--max-length {max_length} must be well above the task's doc_stride {stride}")
    encoded = tokenizer(
        questions,
        contexts,
        truncation="only_second",
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    features = []
    for window, offsets in enumerate(encoded["offset_mapping"]):
        row = rows[encoded["overflow_to_sample_mapping"][window]]
        sequence = encoded.sequence_ids(window)
        start = end = 0
        answers = row["answers"]
        if answers["text"]:
            first = int(answers["answer_start"][0])
            last = first + len(answers["text"][0])
            context = [index for index, owner in enumerate(sequence) if owner == 1]
            if context and offsets[context[0]][0] <= first and offsets[context[-1]][1] >= last:
                start = next(i for i in context if offsets[i][1] > first)
                end = next(i for i in reversed(context) if offsets[i][0] < last)
        feature = {
            name: encoded[name][window]
            for name in ("input_ids", "attention_mask", "token_type_ids")
            if name in encoded
        }
        features.append({**feature, "start_positions": start, "end_positions": end})
    return features
