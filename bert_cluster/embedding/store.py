"""The output folder of an embed run: its settings, lock, shards and manifest, nothing half-written.

``OUT/state.json`` holds the run's settings (model, input content hash, every option, package versions)
and is written before the first shard; a later run on ``OUT`` continues only with the same settings and
is refused otherwise, naming the setting that differs. Each ``OUT/shard-NNNNN.parquet`` is written to a
temporary file, flushed to disk and renamed into place, so a shard file that exists is complete (its
schema metadata repeats the settings' hash, checked on resume). ``OUT/manifest.json`` comes last: it
says the output is whole. ``OUT/.lock`` (``fcntl.flock``, released by the system when its process
dies, even by ``kill -9``) keeps a second run out while one writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bert_cluster.errors import UserError

STATE = "state.json"
MANIFEST = "manifest.json"
LOCK = ".lock"
SHARD_GLOB = "shard-*.parquet"
#: Key of the settings hash in each shard's parquet schema metadata.
FINGERPRINT_KEY = b"bert_cluster.embed.fingerprint"
#: Version of the output layout, part of the settings.
LAYOUT_VERSION = 1


def fingerprint(settings: Mapping[str, Any]) -> str:
    """sha256 of the settings as canonical JSON."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path``: a temporary file beside it, fsync, rename, fsync of the folder."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_folder(path.parent)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON, atomically."""
    write_atomically(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def write_shard(output: Path, name: str, table: Any) -> Path:
    """One shard's table (pyarrow) as parquet, atomically; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    path = output / name
    write_atomically(path, sink.getvalue().to_pybytes())
    return path


@contextlib.contextmanager
def locked(output: Path) -> Iterator[None]:
    """Hold ``OUT/.lock`` for the block; another holder means a ``UserError`` at once (no waiting)."""
    import fcntl

    output.mkdir(parents=True, exist_ok=True)
    handle = open(output / LOCK, "a+")  # noqa: SIM115 - held open for the whole block
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UserError(
                f"{output} is being written by another embed run ({holder}); wait for it, or give another "
                "output folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(stored: Mapping[str, Any], wanted: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Each setting (dotted path) that differs, with both values."""
    found = []
    for key in sorted(set(stored) | set(wanted)):
        before, now = stored.get(key), wanted.get(key)
        if before == now:
            continue
        if isinstance(before, Mapping) and isinstance(now, Mapping):
            found += _differences(before, now, f"{prefix}{key}.")
        else:
            found.append(f"{prefix}{key} (there {_shown(before)}, now {_shown(now)})")
    return found


def _ours(output: Path) -> list[Path]:
    """The files an embed run writes in ``output`` (what --overwrite removes)."""
    names = [STATE, MANIFEST]
    files = [output / name for name in names if (output / name).exists()]
    files += sorted(output.glob(SHARD_GLOB)) + sorted(output.glob(".shard-*.tmp-*"))
    files += sorted(output.glob(f".{STATE}.tmp-*")) + sorted(output.glob(f".{MANIFEST}.tmp-*"))
    return files


def prepare(output: Path, settings: Mapping[str, Any], overwrite: bool) -> dict[str, Any]:
    """Make ``output`` ready for a run with ``settings`` (call holding the lock); returns its state.

    A folder with an earlier run of the same settings is kept (the run continues); one of other settings,
    or one holding other files, is refused unless ``overwrite`` (which removes only an embed run's files).

    Raises:
        UserError: the folder holds another run or other files, and ``overwrite`` is False.
    """
    state_file = output / STATE
    wanted = {"fingerprint": fingerprint(settings), "settings": dict(settings)}
    if overwrite:
        for path in _ours(output):
            path.unlink()
    elif state_file.is_file():
        try:
            stored = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            stored = {}
        if stored.get("fingerprint") != wanted["fingerprint"]:
            found = _differences(stored.get("settings") or {}, wanted["settings"]) or ["its state file"]
            differs = "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")
            raise UserError(
                f"{output} holds an embed run with other settings: {differs}; give another output folder, "
                "or --overwrite to replace it"
            )
    else:
        others = sorted(path.name for path in output.iterdir() if path.name != LOCK)
        if others:
            raise UserError(
                f"{output} is not empty and holds no embed run ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}); give another output folder, or --overwrite"
            )
    for stale in output.glob(".*.tmp-*"):  # a temporary file of a killed run
        stale.unlink()
    if not state_file.is_file():
        write_json(state_file, wanted)
    return wanted


def complete_shards(output: Path, expected_fingerprint: str) -> set[str]:
    """Names of the shard files in ``output`` written by a run of these settings (hash in their metadata)."""
    import pyarrow.parquet as pq

    done = set()
    for path in output.glob(SHARD_GLOB):
        try:
            metadata = pq.read_schema(path).metadata or {}
        except (OSError, ValueError):
            continue  # unreadable: written again
        if metadata.get(FINGERPRINT_KEY) == expected_fingerprint.encode():
            done.add(path.name)
    return done


def read_output(output: str | Path) -> Any:
    """Every shard of a finished output, in order, as one pyarrow table (id, embedding, tokens, truncated).

    Raises:
        UserError: ``output`` has no manifest (the run is not finished) or a shard it lists is missing.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    output = Path(output)
    manifest_file = output / MANIFEST
    if not manifest_file.is_file():
        raise UserError(
            f"{output} has no {MANIFEST}: the embed run is not finished (run it again to continue)"
        )
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    tables = []
    for name in manifest["shards"]:
        if not (output / name).is_file():
            raise UserError(f"{output}: shard {name} listed in the manifest is missing")
        tables.append(pq.read_table(output / name))
    if not tables:
        return pa.table(
            {
                "id": pa.array([], pa.string()),
                "embedding": pa.array([], pa.list_(pa.float32(), manifest["dimension"] or 1)),
                "tokens": pa.array([], pa.int32()),
                "truncated": pa.array([], pa.bool_()),
            }
        )
    return pa.concat_tables(tables)
