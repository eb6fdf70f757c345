"""The ``squad`` task kind: extractive QA over sliding windows, with named span-decoding postprocessors.

A question and its context are split into windows of ``max_length`` tokens overlapping by
``doc_stride``; the model gives start and end logits per token. ``decode_answers`` takes, per window,
the ``n_best`` start and end tokens, keeps spans inside the context with end >= start and at most
``max_answer_length`` tokens, scores a span by start + end logit and keeps the best over all windows.
SQuAD v2 adds the null answer: the lowest [CLS] start + end score over the windows; the prediction is
empty when that null score is greater than the best span's score (threshold 0). Task YAMLs name the
postprocessor (``options.postprocessor``) from ``POSTPROCESSORS``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert_cluster.checkpoints import load_head_checkpoint, load_with_head, max_positions, pad_batch
from bert_cluster.errors import UserError, positive_int
from bert_cluster.tasks.config import TaskConfig
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
from bert_cluster.tasks.metrics import SQUAD_METRICS, squad_scores

_OPTION_DEFAULTS = {"postprocessor": "squad_v1", "doc_stride": 128, "n_best": 20, "max_answer_length": 30}


@dataclasses.dataclass
class Window:
    """One tokenized window: which question it belongs to and each token's character span in the context."""

    example: int
    input_ids: list[int]
    attention_mask: list[int]
    token_type_ids: list[int] | None
    offsets: list[tuple[int, int] | None]  # None: not a context token (question, special, padding)
    cls_index: int = 0

    def features(self) -> dict[str, list[int]]:
        """The model inputs of this window."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids
        return out


def check_stride(tokenizer: Any, questions: Sequence[str], max_length: int, doc_stride: int) -> None:
    """Refuse a ``doc_stride`` that leaves a window no new context token.

    A window holds the question, the special tokens and the context; consecutive windows share
    ``doc_stride`` context tokens, so the stride must be smaller than what the longest question leaves of
    ``max_length`` (the tokenizer would otherwise abort the process).

    Raises:
        UserError: saying what the window leaves and what is allowed.
    """
    lengths = tokenizer(list(questions), add_special_tokens=False)["input_ids"] if questions else []
    longest = max(map(len, lengths), default=0)
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    room = max_length - longest - specials
    if doc_stride >= room:
        raise UserError(
            f"doc_stride {doc_stride} must be smaller than the context a window holds: max_length "
            f"{max_length} less the longest question ({longest} tokens) and {specials} special tokens leaves "
            f"{max(room, 0)}; raise --max-length or lower the task's doc_stride"
        )


def make_windows(
    tokenizer: Any, questions: Sequence[str], contexts: Sequence[str], max_length: int, doc_stride: int
) -> list[Window]:
    """Tokenize question/context pairs into overlapping windows (the context alone is truncated).

    The one place windows are made: ``evaluate`` scores them, ``finetune`` trains on them.
    """
    questions = [question.lstrip() for question in questions]
    check_stride(tokenizer, questions, max_length, doc_stride)
    encoded = tokenizer(
        questions,
        list(contexts),
        truncation="only_second",
        max_length=max_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=False,
    )
    windows = []
    for index, example in enumerate(encoded["overflow_to_sample_mapping"]):
        sequence_ids = encoded.sequence_ids(index)
        offsets = [
            (int(span[0]), int(span[1])) if sequence_ids[position] == 1 else None
            for position, span in enumerate(encoded["offset_mapping"][index])
        ]
        input_ids = encoded["input_ids"][index]
        cls_id = tokenizer.cls_token_id
        windows.append(
            Window(
                example=int(example),
                input_ids=input_ids,
                attention_mask=encoded["attention_mask"][index],
                token_type_ids=encoded["token_type_ids"][index] if "token_type_ids" in encoded else None,
                offsets=offsets,
                cls_index=input_ids.index(cls_id) if cls_id in input_ids else 0,
            )
        )
    return windows


def decode_answers(
    contexts: Sequence[str],
    windows: Sequence[Window],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    *,
    n_best: int = 20,
    max_answer_length: int = 30,
    version_2: bool = False,
) -> list[str]:
    """The predicted answer text of every context (empty: no answer), from per-window logits."""
    best: list[tuple[float, int, int] | None] = [None] * len(contexts)
    null: list[float | None] = [None] * len(contexts)
    for window, starts, ends in zip(windows, start_logits, end_logits, strict=True):
        starts, ends = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
        example = window.example
        null_score = float(starts[window.cls_index] + ends[window.cls_index])
        if null[example] is None or null_score < null[example]:
            null[example] = null_score
        top_starts = np.argsort(-starts, kind="stable")[:n_best]
        top_ends = np.argsort(-ends, kind="stable")[:n_best]
        for start in top_starts:
            start_span = window.offsets[start] if start < len(window.offsets) else None
            if start_span is None:
                continue
            for end in top_ends:
                end_span = window.offsets[end] if end < len(window.offsets) else None
                if end_span is None or end < start or end - start + 1 > max_answer_length:
                    continue
                score = float(starts[start] + ends[end])
                current = best[example]
                if current is None or score > current[0]:
                    best[example] = (score, start_span[0], end_span[1])
    answers = []
    for index, context in enumerate(contexts):
        candidate = best[index]
        if candidate is None or version_2 and null[index] is not None and null[index] > candidate[0]:
            answers.append("")
        else:
            answers.append(context[candidate[1] : candidate[2]])
    return answers


#: Postprocessors a task YAML can name in ``options.postprocessor``, with whether they score v2:
#: SQuAD v1.1 always takes the best span; v2.0 answers nothing when the null score beats it.
POSTPROCESSORS: dict[str, tuple[Callable[..., list[str]], bool]] = {
    "squad_v1": (functools.partial(decode_answers, version_2=False), False),
    "squad_v2": (functools.partial(decode_answers, version_2=True), True),
}


def squad_options(task: TaskConfig) -> dict[str, Any]:
    """The task's SQuAD options with defaults, validated."""
    check_options(task, tuple(_OPTION_DEFAULTS))
    options = {**_OPTION_DEFAULTS, **dict(task.options)}
    if options["postprocessor"] not in POSTPROCESSORS:
        raise UserError(
            f"task {task.name}: postprocessor must be one of {sorted(POSTPROCESSORS)}, "
            f"got {options['postprocessor']!r}"
        )
    for key in ("doc_stride", "n_best", "max_answer_length"):
        positive_int(f"task {task.name}: option {key}", options[key])
    return options


#: The head: the class that loads it, its weights' prefixes, its name in messages.
HEAD = ("AutoModelForQuestionAnswering", ("qa_outputs",), "question-answering")


class SquadKind(HeadTraining):
    """Extractive question answering with a trained ``qa_outputs`` head.

    Trained (``finetune``, loss ``span-cross-entropy``) on the same windows it is scored on, each with the
    answer's start and end token, or the ``[CLS]`` token where the window does not hold the answer (a
    question without one, SQuAD v2), as BERT's SQuAD recipe does.
    """

    name = "squad"
    losses = ("span-cross-entropy",)

    def check(self, task: TaskConfig) -> None:
        """Valid options and SQuAD metric names (v2 adds the HasAns / NoAns subsets)."""
        squad_options(task)
        check_metrics(task, SQUAD_METRICS.__contains__, ", ".join(SQUAD_METRICS))

    def load_model(self, model: str | Path, task: TaskConfig, device: str) -> LoadedModel:
        """Load an ``AutoModelForQuestionAnswering``; refuse one without a trained QA head."""
        import transformers

        auto_class, prefixes, head = HEAD
        loaded, tokenizer = load_with_head(
            model, getattr(transformers, auto_class), prefixes, head, task.name, device
        )
        return LoadedModel(model=loaded, tokenizer=tokenizer, max_positions=max_positions(loaded.config))

    def load_examples(self, task: TaskConfig, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """The first ``limit`` questions (not windows)."""
        rows = load_rows(task, data_dir)
        items = []
        for row in first_n(rows.rows, limit):
            try:
                items.append(
                    {
                        "id": str(row["id"]),
                        "question": str(row["question"]),
                        "context": str(row["context"]),
                        "answers": list(row["answers"]["text"]),
                    }
                )
            except (KeyError, TypeError):
                raise UserError(
                    f"{rows.source}: a SQuAD row needs id, question, context and answers.text; "
                    f"got keys {sorted(row)}"
                ) from None
        return Examples(items=items, source=rows.source, count=len(items))

    def score(
        self,
        loaded: LoadedModel,
        task: TaskConfig,
        examples: Examples,
        settings: ScoreSettings,
        advance: Progress,
    ) -> dict[str, float]:
        """Run every window, decode answers with the task's postprocessor, compute EM/F1."""
        options = squad_options(task)
        max_length = settings.max_length or task.max_length
        key = ("windows", max_length, options["doc_stride"])
        items = examples.items
        if key not in loaded.extra:
            loaded.extra[key] = make_windows(
                loaded.tokenizer,
                [item["question"] for item in items],
                [item["context"] for item in items],
                max_length,
                options["doc_stride"],
            )
        windows: list[Window] = loaded.extra[key]

        def logits(batch: list[Window]) -> list[tuple[np.ndarray, np.ndarray]]:
            with torch.inference_mode():
                output = loaded.model(
                    **pad_batch(loaded.tokenizer, [w.features() for w in batch], settings.device)
                )
            starts = output.start_logits.float().cpu().numpy()
            ends = output.end_logits.float().cpu().numpy()
            return [
                (starts[row, : len(w.input_ids)], ends[row, : len(w.input_ids)])
                for row, w in enumerate(batch)
            ]

        outputs = settings.map(logits, windows, [len(w.input_ids) for w in windows], advance)
        postprocess, version_2 = POSTPROCESSORS[options["postprocessor"]]
        answers = postprocess(
            [item["context"] for item in items],
            windows,
            [start for start, _ in outputs],
            [end for _, end in outputs],
            n_best=options["n_best"],
            max_answer_length=options["max_answer_length"],
        )
        predictions = {item["id"]: answer for item, answer in zip(items, answers, strict=True)}
        references: Mapping[str, list[str]] = {item["id"]: item["answers"] for item in items}
        scores = squad_scores(predictions, references, version_2=version_2)
        return {metric: scores[metric] for metric in task.metric_names if metric in scores}

    # ---------------------------------------------------------------------------------- training

    def check_training(self, task: TaskConfig) -> None:
        """Nothing beyond ``check``: the spans need no labels of the task's."""

    def training_model(
        self, source: str, task: TaskConfig, overrides: Mapping[str, Any] | None = None
    ) -> TrainingModel:
        """The QA model (a fresh ``qa_outputs`` head where the checkpoint has none)."""
        import transformers

        auto_class, prefixes, _ = HEAD
        loaded = load_head_checkpoint(source, getattr(transformers, auto_class), prefixes, None, overrides)
        return TrainingModel(loaded.model, loaded.tokenizer, loaded.source, loaded.has_head, loaded.fresh)

    def check_rows(self, rows: Sequence[dict[str, Any]], task: TaskConfig, where: Locator) -> None:
        """A question, a context and well-formed answers in every row."""

        def check(row: dict[str, Any]) -> None:
            for field in ("question", "context"):
                check_text(row.get(field), field)
            _check_answers(row.get("answers"))

        check_each_row(rows, where, check)

    def training_features(
        self, rows: Sequence[dict[str, Any]], task: TaskConfig, trained: TrainingModel
    ) -> Any:
        """The task's windows (its ``doc_stride``) with ``start_positions`` / ``end_positions``."""
        windows = make_windows(
            trained.tokenizer,
            [str(row["question"]) for row in rows],
            [str(row["context"]) for row in rows],
            trained.max_length,
            squad_options(task)["doc_stride"],
        )
        return [
            {**window.features(), **answer_positions(window, rows[window.example]["answers"])}
            for window in windows
        ]


def _check_answers(answers: Any) -> None:
    texts = answers.get("text") if isinstance(answers, dict) else None
    starts = answers.get("answer_start") if isinstance(answers, dict) else None
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        raise UserError("answers must hold lists 'text' and 'answer_start' of one length")
    if not all(isinstance(text, str) for text in texts):
        raise UserError("every answer text must be a string")
    if not all(isinstance(at, int) and not isinstance(at, bool) and at >= 0 for at in starts):
        raise UserError(f"every answer_start must be a non-negative int, got {starts!r}")


def answer_positions(window: Window, answers: Mapping[str, Any]) -> dict[str, int]:
    """The first answer's start and end token in ``window``.

    Its ``[CLS]`` token for both where the window does not hold the whole answer, or there is none.
    """
    start = end = window.cls_index
    if answers["text"]:
        first = int(answers["answer_start"][0])
        last = first + len(answers["text"][0])
        context = [index for index, span in enumerate(window.offsets) if span is not None]
        offsets = window.offsets
        if context and offsets[context[0]][0] <= first and offsets[context[-1]][1] >= last:
            start = next(i for i in context if offsets[i][1] > first)
            end = next(i for i in reversed(context) if offsets[i][0] < last)
    return {"start_positions": start, "end_positions": end}


SQUAD = register_kind(SquadKind())
