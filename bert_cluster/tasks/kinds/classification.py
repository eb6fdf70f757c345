"""The ``classification`` task kind: GLUE-style sequence (pair) classification, and regression (STS-B).

The checkpoint's label order need not be the dataset's: ``label_mapping`` (in ``tasks.py``, shared with
``finetune``) matches the names in ``config.id2label`` with the task's ``label_names`` and scores through
that permutation, or refuses (never a silently inverted accuracy). Generic names (LABEL_0, LABEL_1, ...)
mean "the dataset's order".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.checkpoints import load_head_checkpoint, load_with_head, max_positions, pad_batch
from bert_cluster.errors import UserError
from bert_cluster.tasks.config import TaskConfig, label_index, label_mapping
from bert_cluster.tasks.data import load_rows
from bert_cluster.tasks.kinds import (
    Examples,
    HeadTraining,
    LoadedModel,
    Locator,
    Progress,
    ScoreSettings,
    TrainingModel,
    check_each_row,
    check_metrics,
    check_options,
    check_text,
    first_n,
    register_kind,
)
from bert_cluster.tasks.metrics import GLUE_METRICS, glue_metric

#: The head: the class that loads it, its weights' prefixes, its name in messages.
HEAD = ("AutoModelForSequenceClassification", ("classifier", "score"), "sequence-classification")


class ClassificationKind(HeadTraining):
    """Sequence classification with a trained ``classifier`` head (``num_labels == 1``: regression).

    Trained (``finetune``) with the head's own loss: ``cross-entropy`` over the classes, ``mse`` for a
    regression score; a checkpoint without the head gets a fresh one with the task's labels.
    """

    name = "classification"
    losses = ("cross-entropy", "mse")

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
        import transformers

        auto_class, prefixes, head = HEAD
        loaded, tokenizer = load_with_head(
            model, getattr(transformers, auto_class), prefixes, head, task.name, device
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

    # ---------------------------------------------------------------------------------- training

    def check_training(self, task: TaskConfig) -> None:
        """``mse`` for a regression (no label names), ``cross-entropy`` for classes."""
        regression = task.label_names is None
        if (task.train.loss == "mse") != regression:
            labels, loss = ("a regression", "mse") if regression else ("classes", "cross-entropy")
            raise UserError(
                f"task {task.name}: loss {task.train.loss} does not fit its labels ({labels}); use {loss}"
            )

    def training_model(
        self, source: str, task: TaskConfig, overrides: Mapping[str, Any] | None = None
    ) -> TrainingModel:
        """The classifier (a fresh head with the task's labels where the checkpoint has none).

        ``extra["to_model"]``: the model's output index of each dataset label (None: the same order).
        """
        import transformers

        auto_class, prefixes, _ = HEAD
        names = list(task.label_names or ["score"])
        new_head = {
            "num_labels": len(names),
            "id2label": dict(enumerate(names)),
            "label2id": {name: index for index, name in enumerate(names)},
        }
        loaded = load_head_checkpoint(
            source, getattr(transformers, auto_class), prefixes, new_head, overrides
        )
        model = loaded.model
        model.config.problem_type = (
            "regression" if task.label_names is None else "single_label_classification"
        )
        mapping = label_mapping(model.config.id2label or {}, model.config.num_labels, task)
        # model index -> dataset index; the labels need the inverse
        to_model = None if mapping is None else [mapping.index(index) for index in range(len(mapping))]
        return TrainingModel(
            model,
            loaded.tokenizer,
            loaded.source,
            loaded.has_head,
            loaded.fresh,
            extra={"to_model": to_model},
        )

    def check_rows(self, rows: Sequence[dict[str, Any]], task: TaskConfig, where: Locator) -> None:
        """Every text field a string, every label one of the task's (or a number for a regression)."""

        def check(row: dict[str, Any]) -> None:
            for field in task.text_fields:
                check_text(row.get(field), field)
            label_index(row.get(task.label_field), task)

        check_each_row(rows, where, check)

    def training_features(
        self, rows: Sequence[dict[str, Any]], task: TaskConfig, trained: TrainingModel
    ) -> Any:
        """Tokenized texts with ``labels`` in the model's label order."""
        to_model = trained.extra.get("to_model")
        columns = [[str(row[field]) for row in rows] for field in task.text_fields]
        encoded = trained.tokenizer(*columns, truncation=True, max_length=trained.max_length)
        features = []
        for index, row in enumerate(rows):
            label = label_index(row[task.label_field], task)
            if task.label_names is not None and to_model is not None:
                label = to_model[label]
            features.append({**{name: encoded[name][index] for name in encoded}, "labels": label})
        return features


CLASSIFICATION = register_kind(ClassificationKind())
