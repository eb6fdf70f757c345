"""Untrained long-position proxies: a short-context checkpoint with its position table copied to more rows.

No long-context BERT-family checkpoint installs offline, yet clustered attention pays only with thousands
of tokens. ``long_position_proxy`` copies a checkpoint's learned absolute position table (P rows) to N rows,
position p taking row p mod P (Longformer's initialisation), with no further training. On inputs of at
most P tokens the proxy computes exactly what the original does; beyond, it measures how far an attention
approximation moves a real model's outputs on long text, not what a trained long-context model would
score. The embedded default's long task (``squad-articles-proxy``) builds one from all-MiniLM-L6-v2 into
the user cache folder (``bert_cluster.crossover.cache_dir``: ``$BERT_CLUSTER_CACHE_DIR``, else
``$XDG_CACHE_HOME/bert-cluster``, else ``~/.cache/bert-cluster``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from bert_cluster.checkpoints import max_positions
from bert_cluster.crossover import cache_dir

#: Files of a checkpoint that hold weights (a proxy rewrites them; everything else is copied).
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
#: Bump when the proxy files change, so caches built by an older version are not reused.
_PROXY_FORMAT = 1
#: The file a proxy records how it was made in (its presence marks a finished build).
RECORD = "bert_cluster_proxy.json"


def _digest(folder: Path) -> str:
    """A hash of a checkpoint's config and weights (a changed source gets a new proxy)."""
    digest = hashlib.sha256()
    for name in ("config.json", *_WEIGHT_FILES):
        path = folder / name
        if path.is_file():
            digest.update(name.encode())
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def long_position_proxy(model: str | Path, positions: int, cache: str | Path | None = None) -> Path:
    """An untrained long-context proxy of a checkpoint with learned absolute positions (built once, cached).

    The position table of ``model`` (P rows) is copied to ``positions`` rows, position p taking row
    p mod P, with no further training; every other weight and file (tokenizer, sentence-transformers
    modules) is kept, and ``max_seq_length`` / ``model_max_length`` become ``positions``. On inputs of at
    most P tokens the proxy computes exactly what the original does.

    Args:
        model: a local checkpoint folder with ``config.json`` and ``model.safetensors``.
        positions: the tokens the proxy takes (position 0 onwards), more than the original's P.
        cache: where to build it (default ``cache_dir()``); the folder name carries a hash of the source.

    Returns:
        The proxy's folder, with ``bert_cluster_proxy.json`` recording how it was made.

    Raises:
        ValueError: ``positions`` not above P, a model without a learned absolute position table, or
            weights not in a single ``model.safetensors``.
    """
    from safetensors.torch import load_file, save_file

    source = Path(model).expanduser().resolve()
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be a positive int, got {positions!r}")
    config_path, weights_path = source / "config.json", source / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{source}: a long-position proxy needs config.json and a single model.safetensors")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{source}: position_embedding_type {config['position_embedding_type']!r}; a long-position proxy "
            "copies a learned absolute position table"
        )
    original = max_positions(SimpleNamespace(**config))
    if original is None:
        raise ValueError(f"{source}: config.json has no max_position_embeddings to extend")
    if positions <= original:
        raise ValueError(
            f"{source} already takes {original} positions; a proxy must have more (asked for {positions})"
        )
    offset = config["max_position_embeddings"] - original  # RoBERTa-style tables start at pad + 1
    folder = Path(cache) if cache is not None else cache_dir()
    target = folder / f"{source.name}-positions-{positions}-{_digest(source)}-v{_PROXY_FORMAT}"
    if (target / RECORD).is_file():
        return target

    state = load_file(str(weights_path))
    keys = [key for key in state if key.endswith("embeddings.position_embeddings.weight")]
    if len(keys) != 1 or state[keys[0]].shape[0] != original + offset:
        raise ValueError(
            f"{source}: expected one learned position table of {original + offset} rows "
            f"(*embeddings.position_embeddings.weight), found {keys}"
        )
    table = state[keys[0]]
    rows = torch.arange(positions) % original + offset
    state[keys[0]] = torch.cat([table[:offset], table[rows]]).contiguous()
    for key in [key for key in state if key.endswith("embeddings.position_ids")]:  # older checkpoints keep it
        state[key] = torch.arange(positions + offset, dtype=state[key].dtype)[None]

    folder.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=folder))
    try:
        shutil.copytree(source, building, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*_WEIGHT_FILES))
        save_file(state, str(building / "model.safetensors"), metadata={"format": "pt"})
        config["max_position_embeddings"] = positions + offset
        (building / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, key in (
            ("sentence_bert_config.json", "max_seq_length"),
            ("tokenizer_config.json", "model_max_length"),
        ):
            path = building / name
            if path.is_file():
                settings = json.loads(path.read_text(encoding="utf-8"))
                settings[key] = positions
                path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        record = {
            "format": _PROXY_FORMAT,
            "source": str(source),
            "source_positions": original,
            "positions": positions,
            "rule": f"position p takes the source's position row (p mod {original})",
            "trained": False,
            "note": "an untrained long-context proxy: for measuring attention approximations on long text",
        }
        (building / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        try:
            building.rename(target)
        except OSError:  # built meanwhile by another process: keep that one
            if not (target / RECORD).is_file():
                raise
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)
    return target
