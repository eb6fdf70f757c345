"""Loading a checkpoint with the head a task needs, and running it in length-sorted, padded batches."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.evaluation.errors import UserError


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_model_path(model: str | Path) -> str:
    """Refuse a local path that does not exist (instead of asking the hub for it)."""
    text = str(model)
    if not text.strip():
        raise UserError("the model path is empty")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model path {path} is not a folder (expected a transformers checkpoint folder)")
        if not (path / "config.json").is_file():
            raise UserError(f"model folder {path} has no config.json: not a transformers checkpoint")
        return str(path)
    looks_local = text.startswith((".", "/", "~")) or os.sep + os.sep in text or text.count("/") > 1
    if looks_local or "\\" in text:
        raise UserError(f"model path {text} does not exist")
    return text


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report (the head check below says what matters) for one load."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        if bars:
            hf_logging.enable_progress_bar()


def load_with_head(
    model: str | Path,
    auto_class: Any,
    head_prefixes: Sequence[str],
    head_name: str,
    task_name: str,
    device: str,
) -> tuple[torch.nn.Module, Any]:
    """Load model and tokenizer; refuse a checkpoint whose task head would be freshly initialised.

    Raises:
        UserError: the path is unreadable, or the checkpoint has no trained ``head_name`` head.
    """
    from transformers import AutoTokenizer

    import bert_cluster  # noqa: F401 - re-applies a saved clustered-attention setting on load

    source = check_model_path(model)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source)
            loaded, info = auto_class.from_pretrained(source, output_loading_info=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot load model {source}: {_first_line(error)}") from None
    missing = [key for key in info.get("missing_keys", []) if key.startswith(tuple(head_prefixes))]
    if missing:
        architectures = ", ".join(getattr(loaded.config, "architectures", None) or ["unknown"])
        raise UserError(
            f"model {source} ({architectures}) has no trained {head_name} head, which task {task_name} needs "
            f"(missing {', '.join(sorted(missing))})"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"model {source}: a fast tokenizer (tokenizer.json) is needed for offsets and windows"
        )
    try:
        loaded = loaded.to(device).eval()
    except (RuntimeError, AssertionError) as error:
        raise UserError(f"cannot move the model to device {device!r}: {_first_line(error)}") from None
    return loaded, tokenizer


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), so padding costs little."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def pad_batch(
    tokenizer: Any, features: Sequence[dict[str, list[int]]], device: str
) -> dict[str, torch.Tensor]:
    """Pad one batch of tokenized features to its longest member, as tensors on ``device``."""
    keys = ("input_ids", "attention_mask", "token_type_ids")
    plain = [{key: feature[key] for key in keys if key in feature} for feature in features]
    batch = tokenizer.pad(plain, padding="longest", return_tensors="pt")
    return {key: value.to(device) for key, value in batch.items()}
