"""What keeps a fine-tuning run from ending silently wrong: finite training, sound checkpoints, same inputs.

The checks behind ``progress.FiniteGuard`` (a non-finite loss, gradient norm or trained weight) and
``progress.CheckpointChecksums`` (a sha256 of every file of each checkpoint); ``newest_intact`` picks the
newest checkpoint whose files are whole (every checksum, or where a checkpoint has none, safetensors' own
reading with finite values, the zip archives' CRCs and the JSON files), naming each one it skips.
``rows_sha256`` and ``weights_sha256`` are the content hashes a resume compares: the rows trained on and
the model's weights as loaded. Nothing here imports transformers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: The checksums of a checkpoint's files, written into it after Trainer saved it.
CHECKSUMS = "finetune-checksums.json"
#: A checkpoint is complete once Trainer wrote this file (it writes it last).
STATE = "trainer_state.json"
_ZIPPED = (".pt", ".pth", ".bin")  # torch.save's archives (optimizer, scheduler, rng, training args)


def finite_parameters(model: Any) -> bool:
    """Whether every trained (requires_grad) weight of ``model`` is finite."""
    import torch

    return all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)


def non_finite(logs: dict[str, Any]) -> list[str]:
    """What of a Trainer log entry (its loss, its gradient norm) is not finite."""
    return [
        f"the {key.replace('_', ' ')} is {logs[key]}"
        for key in ("loss", "grad_norm")
        if isinstance(logs.get(key), (int, float)) and not math.isfinite(logs[key])
    ]


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(checkpoint: Path) -> None:
    """A sha256 of each file of ``checkpoint`` in its ``CHECKSUMS`` file (written atomically)."""
    sums = {
        str(path.relative_to(checkpoint)): sha256_file(path)
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and not path.name.endswith(CHECKSUMS) and f".{CHECKSUMS}.tmp" not in path.name
    }
    temporary = checkpoint / f".{CHECKSUMS}.tmp-{os.getpid()}"
    temporary.write_text(json.dumps(sums, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, checkpoint / CHECKSUMS)


def damage(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (a file missing, changed or unreadable), or None."""
    state = checkpoint / STATE
    try:
        loaded = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{STATE} cannot be read ({type(error).__name__})"
    if not isinstance(loaded, dict) or not isinstance(loaded.get("global_step"), int):
        return f"{STATE} is no Trainer state (no global_step)"
    listed = checkpoint / CHECKSUMS
    if listed.is_file():
        try:
            sums = json.loads(listed.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return f"{CHECKSUMS} cannot be read"
        for name, expected in sorted(sums.items()):
            path = checkpoint / name
            if not path.is_file():
                return f"{name} is missing"
            if sha256_file(path) != expected:
                return f"{name} does not match its checksum"
        return None
    # A checkpoint saved without checksums (by an older version, or killed before they were written).
    for path in sorted(checkpoint.iterdir()):
        why = _unreadable(path)
        if why is not None:
            return f"{path.name} {why}"
    return None


def _unreadable(path: Path) -> str | None:
    """Why a checkpoint file is damaged, by its own format's checks, or None."""
    if path.suffix == ".safetensors":
        import torch
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = handle.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        return f"holds a non-finite value ({name})"
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            return f"cannot be read ({' '.join(str(error).split())[:80]})"
    elif path.suffix in _ZIPPED:
        try:
            with zipfile.ZipFile(path) as archive:
                broken = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError):
            return "cannot be read (not a whole archive)"
        if broken is not None:
            return f"cannot be read ({broken} does not match its CRC)"
    elif path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "cannot be read (not JSON)"
    return None


def checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints under ``folder`` (their ``STATE`` written), newest first."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        number = entry.name.removeprefix("checkpoint-")
        named = entry.name.startswith("checkpoint-") and number.isdigit()
        if named and entry.is_dir() and (entry / STATE).is_file():
            found.append((int(number), entry))
    return [entry for _, entry in sorted(found, reverse=True)]


def newest_intact(folder: Path) -> tuple[Path | None, dict[str, str]]:
    """The newest checkpoint under ``folder`` that is whole, and each newer one skipped (name: why)."""
    skipped = {}
    for checkpoint in checkpoints(folder):
        why = damage(checkpoint)
        if why is None:
            return checkpoint, skipped
        skipped[checkpoint.name] = why
    return None, skipped


def rows_sha256(rows: Iterable[dict[str, Any]]) -> str:
    """sha256 of the rows as canonical JSON, one after another: what a run trains on, whatever the format."""
    digest = hashlib.sha256()
    for row in rows:
        text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
        digest.update(text.encode("utf-8", "surrogatepass") + b"\n")
    return digest.hexdigest()


def weights_sha256(model: Any, leave_out: Sequence[str] = ()) -> str:
    """sha256 of a model's weights (name, dtype, shape, bytes), ``leave_out`` (freshly made ones) aside."""
    import torch

    digest = hashlib.sha256()
    skip = set(leave_out)
    for name, tensor in sorted(model.state_dict().items()):
        if name in skip:
            continue
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}\0{data.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(data.view(torch.uint8).numpy())
    return digest.hexdigest()
