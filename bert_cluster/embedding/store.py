"""The output folder of an embed run: its settings, lock, shards and manifest, nothing half-written.

``OUT/state.json`` holds the run's settings (model, input content hash, every option, package versions)
and the names of the shards it will write; it is written before the first shard. A later run on ``OUT``
continues only with the same settings and is refused otherwise, naming the setting that differs. Each
``OUT/shard-NNNNN.parquet`` is written to a temporary file, flushed to disk and renamed into place, so a
shard file that exists is whole; its schema metadata holds the settings' hash and a sha256 of its
content (ids, embeddings, token counts, truncation flags), which a resume and ``read_output`` recompute:
a damaged shard is embedded again on resume and named by ``read_output``. A resume also checks that
each shard holds the documents the input's first pass puts in it (the hash of its ids): a shard file
renamed or swapped with another is embedded again too. ``OUT/manifest.json`` comes
last: it says the output is whole and lists every shard's checksum. ``OUT/.lock`` (``fcntl.flock``,
released by the system when its process dies, even by ``kill -9``) keeps a second run out while one
writes. ``--overwrite`` removes only the files the folder's own state lists (state, manifest, shards
and their temporary files); a folder holding any other file is refused, naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bert_cluster.embedding.documents import ShardSpan
from bert_cluster.embedding.plan import ids_sha256
from bert_cluster.errors import UserError

STATE = "state.json"
MANIFEST = "manifest.json"
LOCK = ".lock"
SHARD_GLOB = "shard-*.parquet"
#: Key of the settings hash in each shard's parquet schema metadata.
FINGERPRINT_KEY = b"bert_cluster.embed.fingerprint"
#: Key of the shard's content checksum (``content_sha256``) in its parquet schema metadata.
CHECKSUM_KEY = b"bert_cluster.embed.content_sha256"
#: Version of the output layout, part of the settings (2: shards carry a content checksum).
LAYOUT_VERSION = 2
#: The names an embed run gives its shards.
SHARD_NAME = re.compile(r"shard-\d{5}\.parquet")
COLUMNS = ("id", "embedding", "tokens", "truncated")


class DamagedShard(Exception):
    """A shard file that cannot be read, or whose content does not match its checksum."""


def fingerprint(settings: Mapping[str, Any]) -> str:
    """sha256 of the settings as canonical JSON."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _cannot_write(path: Path, error: OSError) -> UserError:
    return UserError(f"cannot write {path}: {error.strerror or error}")


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path``: a temporary file beside it, fsync, rename, fsync of the folder.

    Raises:
        UserError: the file cannot be written (permissions, a full disk, ...); nothing is left behind.
    """
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        _fsync_folder(path.parent)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise _cannot_write(path, error) from None


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON, atomically."""
    write_atomically(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def content_sha256(table: Any) -> str:
    """sha256 of a shard's values (ids, embeddings, token counts, truncation flags), not of its bytes.

    Any change of a value changes it, whatever parquet's encoding and compression made of the file.
    """
    import numpy as np

    digest = hashlib.sha256()
    for identifier in table.column("id").to_pylist():
        encoded = identifier.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    embedding = table.column("embedding").combine_chunks()
    digest.update(f"|{embedding.type.list_size}|".encode())  # not the type's text: its field name varies
    digest.update(np.asarray(embedding.flatten().to_numpy(zero_copy_only=False), dtype="<f4").tobytes())
    digest.update(np.asarray(table.column("tokens").to_numpy(), dtype="<i4").tobytes())
    digest.update(np.asarray(table.column("truncated").to_numpy(zero_copy_only=False), dtype="u1").tobytes())
    return digest.hexdigest()


def write_shard(output: Path, name: str, table: Any) -> tuple[Path, str]:
    """One shard's table (pyarrow) as parquet with its content checksum, atomically; its path and checksum."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    checksum = content_sha256(table)
    metadata = {**(table.schema.metadata or {}), CHECKSUM_KEY: checksum.encode()}
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(metadata), sink)
    path = output / name
    write_atomically(path, sink.getvalue().to_pybytes())
    return path, checksum


def verify_shard(path: Path, fingerprint: str, checksum: str | None = None) -> tuple[Any, str]:
    """The shard's table and checksum, after checking its settings hash and its content checksum.

    Raises:
        DamagedShard: the file cannot be read, was written with other settings, lacks its checksum or its
            values do not match it (or ``checksum``, when given: the manifest's).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as error:
        why = textwrap.shorten(str(error), 120, placeholder=" ...")  # whole words, never cut mid-word
        raise DamagedShard(f"it cannot be read: {why}") from None
    metadata = table.schema.metadata or {}
    if metadata.get(FINGERPRINT_KEY) != fingerprint.encode():
        raise DamagedShard("it was written with other settings")
    if tuple(table.column_names) != COLUMNS:
        raise DamagedShard(f"its columns are {table.column_names}, not {list(COLUMNS)}")
    if CHECKSUM_KEY not in metadata:
        raise DamagedShard("it carries no checksum: an output of layout 1, before checksums; embed it again")
    stored = metadata[CHECKSUM_KEY].decode("ascii", "replace")
    try:
        actual = content_sha256(table)
    except (ValueError, TypeError, pa.ArrowException) as error:
        raise DamagedShard(f"its values cannot be read: {error}") from None
    if actual != stored or (checksum is not None and actual != checksum):
        raise DamagedShard("its content does not match its checksum")
    return table.replace_schema_metadata(None), actual


@contextlib.contextmanager
def locked(output: Path) -> Iterator[None]:
    """Hold ``OUT/.lock`` for the block; another holder means a ``UserError`` at once (no waiting).

    A folder this call created is removed again when the block leaves nothing but the lock in it (a run
    refused before writing anything leaves no trace).
    """
    import fcntl

    created = not output.exists()
    try:
        output.mkdir(parents=True, exist_ok=True)
        handle = open(output / LOCK, "a+")  # noqa: SIM115 - held open for the whole block
    except OSError as error:
        raise _cannot_write(output / LOCK, error) from None
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
        try:
            yield
        finally:
            if created and os.listdir(output) == [LOCK]:
                with contextlib.suppress(OSError):
                    (output / LOCK).unlink()
                    output.rmdir()
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


def _load_state(output: Path) -> dict[str, Any] | None:
    """The folder's embed state, or None when there is none (or the file is no embed state)."""
    try:
        state = json.loads((output / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("fingerprint"), str):
        return None
    settings = state.get("settings")
    return state if isinstance(settings, dict) and "layout" in settings else None


def _listed_shards(state: Mapping[str, Any]) -> list[str]:
    """The shard names a state lists (layout 1 listed none: its documents and shard size give them)."""
    names = state.get("shards")
    if names is None:
        settings = state["settings"]
        try:
            documents = int(settings["input"]["documents"])
            count = -(-documents // int(settings["shard_size"]))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return []
        names = [f"shard-{index:05d}.parquet" for index in range(count)]
    return [name for name in names if isinstance(name, str) and SHARD_NAME.fullmatch(name)]


def _ours(output: Path, state: Mapping[str, Any] | None) -> set[str]:
    """The names in ``output`` an embed run wrote, by its state: what --overwrite may remove.

    The state itself, its manifest (the same settings hash), the shards it lists and the temporary
    files of those; nothing when there is no state.
    """
    present = {path.name for path in output.iterdir()}
    if state is None:  # a run killed while writing its first state
        return {name for name in present if re.fullmatch(rf"\.{re.escape(STATE)}\.tmp-\d+", name)}
    names = {STATE, *_listed_shards(state)}
    try:
        manifest = json.loads((output / MANIFEST).read_text(encoding="utf-8"))
        if isinstance(manifest, dict) and manifest.get("fingerprint") == state["fingerprint"]:
            names.add(MANIFEST)
    except (OSError, ValueError):
        pass
    temporary = {name for name in present if re.fullmatch(r"\.(.+)\.tmp-\d+", name)}
    ours = {name for name in names if name in present}
    ours |= {name for name in temporary if re.fullmatch(r"\.(.+)\.tmp-\d+", name)[1] in names | {MANIFEST}}
    return ours


def _shown_names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_folder(output: Path, overwrite: bool) -> None:
    """Refuse, before any work, a folder that holds files no embed run wrote there (call holding the lock).

    Without ``overwrite`` a folder with no embed state must be empty; with it, every file must be one
    the folder's own state lists (``--overwrite`` removes only those).

    Raises:
        UserError: the folder holds other files.
    """
    present = sorted(path.name for path in output.iterdir() if path.name != LOCK)
    state = _load_state(output)
    if state is None and STATE in present:
        raise UserError(
            f"{output / STATE} is damaged or no embed run's state, so which files are an embed run's is "
            "unknown: remove them yourself, or give another output folder"
        )
    others = [name for name in present if name not in _ours(output, state)]
    if overwrite and others:
        raise UserError(
            f"{output} holds files no embed run wrote there ({_shown_names(others)}): --overwrite removes "
            "only the files an embed run's state lists; move them away, or give another output folder"
        )
    if not overwrite and state is None and others:
        raise UserError(
            f"{output} is not empty and holds no embed run ({_shown_names(others)}); give another output "
            "folder (--overwrite removes only an embed run's own files)"
        )


def prepare(output: Path, settings: Mapping[str, Any], overwrite: bool, shards: list[str]) -> dict[str, Any]:
    """Make ``output`` ready for a run with ``settings`` writing ``shards`` (call holding the lock).

    A folder with an earlier run of the same settings is kept (the run continues); one of other settings
    is refused unless ``overwrite``, which removes the files its state lists (and refuses any other).

    Raises:
        UserError: the folder holds another run and ``overwrite`` is False, or it holds other files.
    """
    check_folder(output, overwrite)
    state_file = output / STATE
    wanted = {"fingerprint": fingerprint(settings), "settings": dict(settings), "shards": list(shards)}
    stored = _load_state(output)
    if overwrite:
        for name in sorted(_ours(output, stored)):
            try:
                (output / name).unlink(missing_ok=True)
            except OSError as error:
                raise UserError(f"cannot remove {output / name}: {error.strerror or error}") from None
        stored = None
    elif stored is not None and stored["fingerprint"] != wanted["fingerprint"]:
        found = _differences(stored["settings"], wanted["settings"]) or ["its state file"]
        differs = "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")
        raise UserError(
            f"{output} holds an embed run with other settings: {differs}; give another output folder, "
            "or --overwrite to replace it"
        )
    for name in _ours(output, stored):  # a temporary file of a killed run
        if name.startswith("."):
            (output / name).unlink(missing_ok=True)
    if stored is None:
        write_json(state_file, wanted)
    return wanted


def complete_shards(
    output: Path, fingerprint: str, names: list[str], spans: Mapping[str, ShardSpan]
) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
    """Of the shards ``names``: those sound (name: checksum), damaged (name: why), and truncated counts.

    The third maps each sound shard to how many of its documents were truncated. Each is read whole, its
    checksum recomputed and its ids compared with ``spans[name]`` (what the input's first pass puts in
    it); a missing shard is in neither.
    """
    done, damaged, truncated = {}, {}, {}
    for name in names:
        path = output / name
        if not path.is_file():
            continue
        try:
            table, checksum = verify_shard(path, fingerprint)
            _check_documents(table.column("id").to_pylist(), spans[name])
        except DamagedShard as error:
            damaged[name] = str(error)
            continue
        done[name] = checksum
        truncated[name] = sum(table.column("truncated").to_pylist())
    return done, damaged, truncated


def _check_documents(ids: list[str], span: ShardSpan) -> None:
    """Refuse a shard that holds other documents than ``span`` (a shard file renamed or swapped)."""
    if ids_sha256(ids) == span.ids_sha256:
        return
    held = f"ids {ids[0]!r} to {ids[-1]!r}" if ids else "no document"
    raise DamagedShard(
        f"it holds other documents ({held}) than this shard's (ids {span.first_id!r} to {span.last_id!r})"
    )


def read_output(output: str | Path) -> Any:
    """Every shard of a finished output, in order, as one pyarrow table (id, embedding, tokens, truncated).

    Each shard's content is checked against its checksum (in the shard and in the manifest).

    Raises:
        UserError: ``output`` has no manifest (the run is not finished), or a shard it lists is missing
            or damaged (named; running the same embed command again re-embeds it).
    """
    import pyarrow as pa

    output = Path(output)
    manifest_file = output / MANIFEST
    if not manifest_file.is_file():
        raise UserError(
            f"{output} has no {MANIFEST}: the embed run is not finished (run it again to continue)"
        )
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        names, checksums = list(manifest["shards"]), dict(manifest.get("checksums") or {})
        key = str(manifest["fingerprint"])
        if not all(isinstance(name, str) and SHARD_NAME.fullmatch(name) for name in names):
            raise ValueError("a shard name that is none")
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{manifest_file} is damaged: run the same embed command again") from None
    tables = []
    for name in names:
        if not (output / name).is_file():
            raise UserError(f"{output}: shard {name} listed in the manifest is missing")
        try:
            tables.append(verify_shard(output / name, key, checksums.get(name))[0])
        except DamagedShard as error:
            raise UserError(
                f"{output}: shard {name} is damaged ({error}); run the same embed command again to "
                "embed it anew"
            ) from None
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
