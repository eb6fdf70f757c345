"""The ``masked-lm`` task kind: a masked language model, trained and scored on text split by file.

A task's rows are files (``path``, and the text in its one ``text_fields`` field; ``package-source``
reads every ``.py`` file of a pinned installed package). The files are split BY FILE: a file whose path
hashes (sha256) into the first ``options.held_out_percent`` of 100 buckets is held out, every other file
trains, so no file is on both sides whatever order the files come in. Each side's files are tokenized
without special tokens and joined, in path order, into one stream of token ids, cut into windows of
``max_length`` tokens (a byte-level tokenizer, transformers' ``ByT5Tokenizer``: a window of 4,096 tokens is
4,096 bytes).

Masks, as BERT's: ``options.masking_rate`` of a window's tokens (15 %: exactly round(rate x length)),
chosen by a generator seeded with the seed and the window's number, so a window's mask is the same in
every run and after a resume; a chosen token becomes the mask token (80 %), a random token (10 %) or
stays (10 %). Training windows are all the train stream's (masked by the run's seed); the held-out split
is ``options.held_out_windows`` (32) windows spread evenly over the held-out stream, masked by
``options.mask_seed`` (fixed, whatever the run's seed), every chosen token the mask token. The metric,
``loss``: the mean cross-entropy over the held-out masked tokens, in nats per token.

The model: a checkpoint folder (continued pretraining; for a longer length, first give it more
positions with ``bert_cluster.tasks.proxy.long_position_proxy``) or a model config ``.json`` (random
weights, e.g. ``configs/models/byte_bert_4k.json``), through ``bert_cluster.checkpoints``. A byte-level
tokenizer has no mask token: its first sentinel (``<extra_id_0>``) plays it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.checkpoints import (
    is_model_config,
    load_model_config,
    max_positions,
    quiet,
)
from bert_cluster.errors import UserError, one_line
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
    check_text,
    register_kind,
)

#: Task options and their defaults.
OPTIONS: dict[str, Any] = {
    "masking_rate": 0.15,
    "held_out_percent": 10,
    "held_out_windows": 32,
    "mask_seed": 0,
}
METRICS = ("loss",)
#: Of the masked tokens: the share replaced by the mask token, by a random token (the rest stay).
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1


def mlm_options(task: TaskConfig) -> dict[str, Any]:
    """The task's options with their defaults, validated.

    Raises:
        UserError: an unknown option or a value out of range.
    """
    unknown = sorted(set(task.options) - set(OPTIONS))
    if unknown:
        raise UserError(
            f"task {task.name}: unknown option(s) {unknown} for kind masked-lm; allowed: {list(OPTIONS)}"
        )
    options = {**OPTIONS, **task.options}
    rate = options["masking_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1:
        raise UserError(f"task {task.name}: masking_rate must be a number in (0, 1), got {rate!r}")
    for key, low, high in (
        ("held_out_percent", 1, 99),
        ("held_out_windows", 1, None),
        ("mask_seed", 0, None),
    ):
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            allowed = f"an int from {low}" + (f" to {high}" if high else "")
            raise UserError(f"task {task.name}: {key} must be {allowed}, got {value!r}")
    return options


def held_out_file(path: str, percent: int) -> bool:
    """Whether the file at ``path`` is held out: its sha256 in the first ``percent`` of 100 buckets."""
    return int(hashlib.sha256(path.encode("utf-8")).hexdigest(), 16) % 100 < percent


def split_files(rows: Sequence[Mapping[str, Any]], percent: int, held_out: bool) -> list[Mapping[str, Any]]:
    """The rows of one side of the by-file split, in path order."""
    chosen = [row for row in rows if held_out_file(str(row["path"]), percent) == held_out]
    return sorted(chosen, key=lambda row: str(row["path"]))


def token_stream(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """The texts' token ids, without special tokens, joined into one stream (int64).

    A byte-level tokenizer (``ByT5Tokenizer``) maps a byte b to b + its offset: that, computed on the bytes
    at once, is what its own Python loop gives.
    """
    offset = getattr(tokenizer, "offset", None)
    if type(tokenizer).__name__ == "ByT5Tokenizer" and isinstance(offset, int):
        data = b"".join(text.encode("utf-8") for text in texts)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) + offset
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return torch.tensor([token for row in ids for token in row], dtype=torch.int64)


def mask_window(
    window: torch.Tensor, rate: float, seed: int, number: int, mask_id: int, vocabulary: int, mixed: bool
) -> dict[str, torch.Tensor]:
    """``input_ids`` with ``rate`` of the tokens masked, and ``labels`` (-100 where not masked).

    The generator is seeded with ``(seed, number)``: the same window gets the same mask every time.
    ``mixed``: BERT's 80 / 10 / 10 (mask token / random token / unchanged); else every one the mask token.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + number)
    length = len(window)
    chosen = torch.randperm(length, generator=generator)[: max(1, round(rate * length))]
    labels = torch.full_like(window, -100)
    labels[chosen] = window[chosen]
    inputs = window.clone()
    if mixed:
        draw = torch.rand(len(chosen), generator=generator)
        randoms = torch.randint(vocabulary, (len(chosen),), generator=generator)
        inputs[chosen] = torch.where(
            draw < MASK_SHARE, mask_id, torch.where(draw < MASK_SHARE + RANDOM_SHARE, randoms, window[chosen])
        )
    else:
        inputs[chosen] = mask_id
    return {"input_ids": inputs, "attention_mask": torch.ones_like(window), "labels": labels}


class MaskedWindows(torch.utils.data.Dataset):
    """A stream cut into windows of ``length`` tokens, each masked the same way every time it is read."""

    def __init__(
        self, stream: torch.Tensor, length: int, rate: float, seed: int, mask_id: int, vocabulary: int
    ) -> None:
        self.stream, self.length, self.rate, self.seed = stream, length, rate, seed
        self.mask_id, self.vocabulary = mask_id, vocabulary

    def __len__(self) -> int:
        return len(self.stream) // self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        window = self.stream[index * self.length : (index + 1) * self.length]
        return mask_window(window, self.rate, self.seed, index, self.mask_id, self.vocabulary, mixed=True)


def mask_token_id(tokenizer: Any) -> int:
    """The mask token's id: the tokenizer's, else its first sentinel (``<extra_id_0>``) made the mask token.

    Raises:
        UserError: the tokenizer has neither.
    """
    if tokenizer.mask_token is None:
        sentinels = list(getattr(tokenizer, "extra_special_tokens", None) or [])
        if not sentinels:
            raise UserError(
                f"the tokenizer {type(tokenizer).__name__} has no mask token for masked-LM training"
            )
        tokenizer.mask_token = sentinels[0]
    return int(tokenizer.mask_token_id)


def held_out_windows(
    tokenizer: Any, rows: Sequence[Mapping[str, Any]], task: TaskConfig, length: int
) -> list[dict[str, torch.Tensor]]:
    """The held-out split: ``held_out_windows`` windows spread evenly over the held-out files' stream.

    Masked by ``mask_seed``, every masked token the mask token.
    """
    options = mlm_options(task)
    files = split_files(rows, options["held_out_percent"], held_out=True)
    stream = token_stream(tokenizer, [str(row[task.text_fields[0]]) for row in files])
    count, wanted = len(stream) // length, options["held_out_windows"]
    if count < wanted:
        raise UserError(
            f"task {task.name}: the held-out files make {count} windows of {length} tokens; "
            f"{wanted} are asked for (lower --max-length or held_out_windows, or hold out more files)"
        )
    starts = [(index * count // wanted) * length for index in range(wanted)]
    mask_id = mask_token_id(tokenizer)
    return [
        mask_window(stream[at : at + length], options["masking_rate"], options["mask_seed"], number, mask_id,
                    len(tokenizer), mixed=False)
        for number, at in enumerate(starts)
    ]  # fmt: skip


def _load_masked_lm(source: str, overrides: Mapping[str, Any] | None = None) -> tuple[Any, Any, bool]:
    """Model and tokenizer from a checkpoint folder, or random weights from a model config; is it fresh."""
    import transformers

    if is_model_config(source):
        loaded = load_model_config(source, transformers.AutoModelForMaskedLM)
        for key, value in (overrides or {}).items():
            setattr(loaded.model.config, key, value)
        return loaded.model, loaded.tokenizer, True
    try:
        with quiet():
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
            model = transformers.AutoModelForMaskedLM.from_pretrained(source, **dict(overrides or {}))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot load model {source}: {one_line(error)}") from None
    return model, tokenizer, False


class MaskedLMKind(HeadTraining):
    """Masked language modelling: trained on the train files' windows, scored on fixed held-out masks."""

    name = "masked-lm"
    losses = ("masked-lm",)
    lora = False  # pretraining trains every weight
    distillable = False

    def check(self, task: TaskConfig) -> None:
        """One text field, the ``loss`` metric, valid options."""
        if len(task.text_fields) != 1:
            raise UserError(
                f"task {task.name}: masked-lm needs one text field (a file's text), "
                f"got {list(task.text_fields)}"
            )
        mlm_options(task)
        check_metrics(task, METRICS.__contains__, ", ".join(METRICS))

    def load_model(self, model: str | Path, task: TaskConfig, device: str) -> LoadedModel:
        """The masked-LM checkpoint (its ``cls`` head: a model without one is refused)."""
        loaded, tokenizer, fresh = _load_masked_lm(str(model))
        if fresh:
            raise UserError(
                f"task {task.name} scores a trained model; {model} is a model config (random weights)"
            )
        return self.scoring_model(TrainingModel(loaded.to(device).eval(), tokenizer, str(model)))

    def load_examples(self, task: TaskConfig, data_dir: Sequence[Path] | None, limit: int | None) -> Examples:
        """The held-out files' rows (their windows are made with the model's tokenizer, at scoring)."""
        rows = load_rows(task, data_dir)
        options = mlm_options(task)
        files = split_files(rows.rows, options["held_out_percent"], held_out=True)
        windows = min(options["held_out_windows"], limit or options["held_out_windows"])
        return Examples(
            items=(rows.rows, limit), source=rows.source, count=windows, notes={"files": len(files)}
        )

    def score(
        self, loaded: LoadedModel, task: Any, examples: Examples, settings: ScoreSettings, advance: Progress
    ) -> dict[str, float]:
        """``loss``: the mean cross-entropy over every held-out masked token, nats per token."""
        length = settings.max_length or task.max_length
        key = ("windows", length)
        if key not in loaded.extra:
            rows, limit = examples.items
            windows = held_out_windows(loaded.tokenizer, rows, task, length)
            loaded.extra[key] = windows if limit is None else windows[:limit]
        windows = loaded.extra[key]
        model = loaded.model

        def losses(batch: list[dict[str, torch.Tensor]]) -> list[tuple[float, int]]:
            inputs = {name: torch.stack([w[name] for w in batch]).to(settings.device) for name in batch[0]}
            labels = inputs.pop("labels")
            with torch.inference_mode():
                logits = model(**inputs).logits.float()
            total = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
            ).reshape(labels.shape)
            return [(float(total[row].sum()), int((labels[row] != -100).sum())) for row in range(len(batch))]

        parts = settings.map(losses, windows, [length] * len(windows), advance)
        return {"loss": sum(s for s, _ in parts) / max(1, sum(n for _, n in parts))}

    # ---------------------------------------------------------------------------------- training

    def check_training(self, task: TaskConfig) -> None:
        """Nothing beyond ``check``: the masks are the labels."""

    def training_model(
        self, source: str, task: TaskConfig, overrides: Mapping[str, Any] | None = None
    ) -> TrainingModel:
        """The masked-LM model: a checkpoint's, or random weights from a model config (``fresh``)."""
        model, tokenizer, fresh = _load_masked_lm(source, overrides)
        mask_token_id(tokenizer)
        return TrainingModel(model, tokenizer, source, has_head=not fresh)

    def scoring_model(self, trained: TrainingModel) -> LoadedModel:
        """The model as ``score`` takes it."""
        return LoadedModel(
            model=trained.model, tokenizer=trained.tokenizer, patched=trained.target,
            max_positions=max_positions(trained.target.config),
        )  # fmt: skip

    def check_rows(self, rows: Sequence[dict[str, Any]], task: TaskConfig, where: Locator) -> None:
        """A path and a text in every row."""
        field = task.text_fields[0]

        def check(row: dict[str, Any]) -> None:
            check_text(row.get("path"), "path")
            check_text(row.get(field), field)

        check_each_row(rows, where, check)

    def training_features(
        self, rows: Sequence[dict[str, Any]], task: TaskConfig, trained: TrainingModel
    ) -> MaskedWindows:
        """The train files' windows of ``trained.max_length`` tokens, masked by the run's seed."""
        options, max_length = mlm_options(task), trained.max_length
        files = split_files(rows, options["held_out_percent"], held_out=False)
        stream = token_stream(trained.tokenizer, [str(row[task.text_fields[0]]) for row in files])
        windows = MaskedWindows(
            stream,
            max_length,
            options["masking_rate"],
            trained.seed,
            mask_token_id(trained.tokenizer),
            len(trained.tokenizer),
        )
        if len(windows) == 0:
            raise UserError(f"task {task.name}: the train files make no window of {max_length} tokens")
        return windows

    def collator(self, trained: TrainingModel) -> Any:
        """The windows are whole: nothing to pad."""
        import transformers

        return transformers.default_data_collator


MASKED_LM = register_kind(MaskedLMKind())
