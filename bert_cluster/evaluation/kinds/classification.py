"""The ``classification`` task kind: GLUE-style sequence (pair) classification, and regression (STS-B).

The checkpoint's label order need not be the dataset's: ``label_mapping`` matches the names in
``config.id2label`` with the task's ``label_names`` and scores through that permutation, or refuses
(never a silently inverted accuracy). Generic names (LABEL_0, LABEL_1, ...) mean "the dataset's order".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.checkpoints import load_with_head, max_positions, pad_batch
from bert_cluster.errors import UserError
from bert_cluster.evaluation.data import load_rows
from bert_cluster.evaluation.kinds import (
    Examples,
    LoadedModel,
    Progress,
    ScoreSettings,
    check_metrics,
    check_options,
    first_n,
    register_kind,
)
from bert_cluster.evaluation.metrics import GLUE_METRICS, glue_metric
from bert_cluster.evaluation.tasks import TaskConfig

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


class ClassificationKind:
    """Sequence classification with a trained ``classifier`` head (``num_labels == 1``: regression)."""

    name = "classification"

    def check(self, task: TaskConfig) -> None:
        """One or two text fields, a label field, GLUE metric names, no options."""
        if not task.text_fields or not 1 <= len(task.text_fields) <= 2:
            raise UserError(f"task {task.name}: classification needs one or two text_fields")
        if task.label_field is None:
            raise UserError(f"task {task.name}: classification needs a label_field")
        check_options(task, ())
        check_metrics(task, GLUE_METRICS.__contains__, ", ".join(GLUE_METRICS))

    def load_model(self, model: str | Path, task: TaskConfig, device: str) -> LoadedModel:
        """Load an ``AutoModelForSequenceClassification`` and work out its label mapping."""
        from transformers import AutoModelForSequenceClassification

        loaded, tokenizer = load_with_head(
            model,
            AutoModelForSequenceClassification,
            ("classifier", "score"),
            "sequence-classification",
            task.name,
            device,
        )
        mapping = label_mapping(loaded.config.id2label or {}, loaded.config.num_labels, task)
        return LoadedModel(
            model=loaded,
            tokenizer=tokenizer,
            max_positions=max_positions(loaded.config),
            extra={"label_mapping": mapping},
        )

    def load_examples(self, task: TaskConfig, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """The first ``limit`` dev rows, labels as dataset indices (or scores)."""
        rows = load_rows(task, data_dir)
        items = [
            {
                "texts": tuple(str(row[field]) for field in task.text_fields),
                "label": label_index(row[task.label_field], task),
            }
            for row in first_n(rows.rows, limit)
        ]
        return Examples(items=items, source=rows.source, count=len(items))

    def score(
        self,
        loaded: LoadedModel,
        task: TaskConfig,
        examples: Examples,
        settings: ScoreSettings,
        advance: Progress,
    ) -> dict[str, float]:
        """Predict every example (length-sorted, dynamically padded batches) and compute the metrics."""
        max_length = settings.max_length or task.max_length
        key = ("encodings", max_length)
        if key not in loaded.extra:
            columns = list(zip(*[item["texts"] for item in examples.items], strict=True))
            encoded = loaded.tokenizer(*columns, truncation=True, max_length=max_length)
            loaded.extra[key] = [
                {name: encoded[name][index] for name in encoded} for index in range(len(examples.items))
            ]
        features = loaded.extra[key]
        regression = task.label_names is None
        mapping = loaded.extra.get("label_mapping")

        def predict(batch: list[dict[str, list[int]]]) -> list[Any]:
            with torch.inference_mode():
                logits = (
                    loaded.model(**pad_batch(loaded.tokenizer, batch, settings.device)).logits.float().cpu()
                )
            if regression:
                return logits[:, 0].tolist()
            values = logits.argmax(dim=-1).tolist()
            return values if mapping is None else [mapping[value] for value in values]

        lengths = [len(feature["input_ids"]) for feature in features]
        predictions = settings.map(predict, features, lengths, advance)
        references = [item["label"] for item in examples.items]
        return {metric: glue_metric(metric, predictions, references) for metric in task.metric_names}


CLASSIFICATION = register_kind(ClassificationKind())
