"""The ``classification`` task kind: GLUE-style sequence (pair) classification, and regression (STS-B).

The checkpoint's label order need not be the dataset's: ``label_mapping`` (in ``tasks.py``, shared with
``finetune``) matches the names in ``config.id2label`` with the task's ``label_names`` and scores through
that permutation, or refuses (never a silently inverted accuracy). Generic names (LABEL_0, LABEL_1, ...)
mean "the dataset's order".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.checkpoints import load_with_head, max_positions, pad_batch
from bert_cluster.errors import UserError
from bert_cluster.tasks.config import TaskConfig, label_index, label_mapping
from bert_cluster.tasks.data import load_rows
from bert_cluster.tasks.kinds import (
    Examples,
    LoadedModel,
    Progress,
    ScoreSettings,
    check_metrics,
    check_options,
    first_n,
    register_kind,
)
from bert_cluster.tasks.metrics import GLUE_METRICS, glue_metric


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
