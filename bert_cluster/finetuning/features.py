"""A task's training rows as the features a transformers head computes its own loss from.

One function per ``train.loss`` of the task configs: ``cross-entropy`` (class indices in the model's
label order), ``mse`` (a float score) and ``span-cross-entropy`` (SQuAD: windows of the context with the
answer's start and end token, or the ``[CLS]`` token where the window does not hold the answer, as
BERT's SQuAD recipe does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bert_cluster.errors import UserError
from bert_cluster.evaluation.tasks import TaskConfig, label_index


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
