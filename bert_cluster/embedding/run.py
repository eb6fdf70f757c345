"""``embed``: a corpus into parquet shards of sentence embeddings, resumable, in one or several processes.

The model is a ``SentenceTransformer`` folder (its own Transformer, Pooling, Dense and Normalize modules)
or a plain transformers folder (sentence-transformers then adds mean pooling; the manifest says so),
converted with ``convert``'s defaults unless ``exact``. The input is read twice, as a stream: a first
pass hashes and counts it (and refuses a malformed one) keeping no document; the second reads, tokenises
and embeds it one shard at a time, each shard written (``store.py``) before the next is read, so memory
holds one shard of documents whatever the corpus's size. Every document is encoded by
``SentenceTransformer.encode``, one planned batch at a time (``plan.py``). Under ``accelerate launch`` or
``torchrun`` process r runs shards r, r + P, ...; rank 0 holds the output's lock and writes the manifest.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bert_cluster import config as presets
from bert_cluster.checkpoints import ENCODER_DTYPES, encode_batch, open_sentence_encoder
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.embedding import store
from bert_cluster.embedding.documents import Document, Input, InputChanged, Problem, Scan, open_documents
from bert_cluster.embedding.plan import Shard, batches_within, count_tokens, shard_names
from bert_cluster.errors import UserError, positive_int

DTYPES = ENCODER_DTYPES
#: Padded tokens per model pass (rows x longest row): 32 documents of 512 tokens.
DEFAULT_TOKENS_PER_BATCH = 16384
#: Documents per output shard (and per unit of resume).
DEFAULT_SHARD_SIZE = 10000

#: ``progress(documents_done, tokens_done, documents_total, tokens_total)`` for this process's share.
Progress = Callable[[int, int, int, int], None]


@dataclasses.dataclass
class EmbedResult:
    """What an embed run produced (also in ``OUT/manifest.json``)."""

    output: Path
    documents: int
    truncated: int
    problems: list[Problem]
    shards: int
    resumed_shards: int
    dimension: int | None
    seconds: float
    documents_per_second: float | None
    tokens_per_second: float | None
    manifest: dict[str, Any]
    #: Shards found damaged (name: why) and embedded again by this run.
    damaged_shards: dict[str, str] = dataclasses.field(default_factory=dict)


class EmbedInterrupted(Exception):
    """Ctrl-C during a run: ``written`` shards of ``total`` are complete in ``output``; rerun to continue."""

    def __init__(self, output: Path, written: int, total: int) -> None:
        super().__init__(f"interrupted: {written} of {total} shards complete in {output}")
        self.output, self.written, self.total = output, written, total


def _attention_config(
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None,
) -> ClusteredAttentionConfig:
    """A config as given, or ``convert``'s preset with the settings of a mapping."""
    from bert_cluster.checkpoints import attention_config

    return attention_config(attention, {}, preset=presets.CONVERT_SETTINGS)


def _model_files(path: str) -> dict[str, list[int]]:
    """Size and modification time of each file of a local model folder (a resume checks them)."""
    folder = Path(path)
    if not folder.is_dir():
        return {}
    return {
        str(file.relative_to(folder)): [file.stat().st_size, file.stat().st_mtime_ns]
        for file in sorted(folder.rglob("*"))
        if file.is_file() and ".cache" not in file.parts
    }


def _check(
    dtype: str, max_length: int | None, max_tokens_per_batch: int, shard_size: int, device: str
) -> None:
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_length is not None:
        positive_int("max_length", max_length)
    positive_int("max_tokens_per_batch", max_tokens_per_batch)
    positive_int("shard_size", shard_size)
    if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def _shard_table(
    documents: Sequence[Document], tokens: list[int], vectors: Any, max_length: int, key: str
) -> Any:
    """One shard's table; ``tokens`` are the documents' token counts (untruncated)."""
    import numpy as np
    import pyarrow as pa

    matrix = np.ascontiguousarray(vectors, dtype=np.float32)
    table = pa.table(
        {
            "id": pa.array([document.id for document in documents], pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), matrix.shape[1]),
            "tokens": pa.array(tokens, pa.int32()),
            "truncated": pa.array([count > max_length for count in tokens], pa.bool_()),
        }
    )
    return table.replace_schema_metadata({store.FINGERPRINT_KEY: key.encode()})


def _encode_shard(
    encoder: Any, shard: Shard, documents: Sequence[Document], lengths: list[int], advance: Callable
) -> Any:
    """The shard's embeddings in document order: one ``encode`` call per planned batch.

    ``shard``'s positions index ``documents`` (the shard's own), as ``lengths`` does.
    """
    import numpy as np

    rows: dict[int, Any] = {}
    for batch in shard.batches:
        vectors = encode_batch(encoder, [documents[position].text for position in batch])
        rows.update(zip(batch, vectors, strict=True))
        advance(len(batch), sum(lengths[position] for position in batch))
    return np.stack([rows[position] for position in shard.documents])


def embed(
    model: str | Path,
    input: str | Path,  # noqa: A002 - the CLI's INPUT
    output: str | Path,
    *,
    text_field: str | None = None,
    id_field: str | None = None,
    json_field: str | None = None,
    split: str | None = None,
    exact: bool = False,
    attention: ClusteredAttentionConfig | Mapping[str, Any] | None = None,
    dtype: str = "float32",
    max_length: int | None = None,
    max_tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH,
    shard_size: int = DEFAULT_SHARD_SIZE,
    device: str = "cpu",
    overwrite: bool = False,
    progress: Progress | None = None,
) -> EmbedResult:
    """Embed every document of ``input`` with ``model`` into parquet shards in ``output``.

    Args:
        model: a SentenceTransformer or transformers folder, ``package:NAME``, or a hub id.
        input: see ``bert_cluster.embedding.documents.read_documents`` (text_field, id_field, json_field
            and split too).
        output: the folder of ``shard-NNNNN.parquet`` (id, embedding, tokens, truncated) and
            ``manifest.json``; an unfinished run of the same settings there is continued.
        exact: keep the model's own attention (no ``convert``).
        attention: clustered-attention settings over ``convert``'s defaults (a mapping), or a config.
        dtype: float32 or bfloat16 (the embeddings are float32 either way).
        max_length: truncation in tokens (default: the model's positions); truncated documents are counted.
        max_tokens_per_batch: padded tokens (rows x longest row) per model pass.
        shard_size: documents per shard.
        device: cpu, cuda or cuda:N (launched processes on GPUs take one GPU each).
        overwrite: replace an embed run of other settings in ``output``: only the files its state lists
            are removed; any other file in the folder is refused.
        progress: called after each batch with this process's documents and tokens done and to do.

    Raises:
        UserError: a bad argument, an unreadable, malformed or empty input, an unreadable model, an
            output of other settings or holding other files, an output another run is writing (checked
            before any work), or a write that fails.
        EmbedInterrupted: Ctrl-C; the shards written so far stay and the same call continues from them.
    """
    _check(dtype, max_length, max_tokens_per_batch, shard_size, device)
    config = None if exact else _attention_config(attention)
    output = Path(output).expanduser()
    if output.exists() and not output.is_dir():
        raise UserError(f"output {output} exists and is not a folder")
    from bert_cluster.checkpoints import check_apart

    check_apart(model, output)  # before the lock, which creates the folder

    from bert_cluster.parallel import Workers

    workers = Workers(device)
    with contextlib.ExitStack() as held:
        # The lock and the folder's check come first: a second writer is refused before any work.
        failure = None
        if workers.is_main:
            try:
                held.enter_context(store.locked(output))
                store.check_folder(output, overwrite)
            except UserError as error:
                failure = str(error)
        failures = [message for message in workers.gather([failure]) if message]
        if failures:
            raise UserError(failures[0])
        source = open_documents(input, text_field, id_field, json_field, split)
        # To the end, keeping no document: the counts, the hashes (the whole and each shard's), any refusal.
        scan = source.scan(shard_size)
        encoder = open_sentence_encoder(model, workers.device(device), dtype, max_length, config)
        max_length = encoder.max_length
        plan = shard_names(scan.documents, shard_size)

        import torch

        settings = {
            "layout": store.LAYOUT_VERSION,
            "model": {"path": encoder.path, "files": _model_files(encoder.path)},
            "input": {
                "source": scan.source,
                "content_sha256": scan.fingerprint,
                "documents": scan.documents,
                "problems": len(scan.problems),
                "text_field": text_field,
                "id_field": id_field,
                "json_field": json_field,
                "split": split,
            },
            "exact": exact,
            "attention": None if config is None else config.to_dict(),
            "dtype": dtype,
            "max_length": max_length,
            "max_tokens_per_batch": max_tokens_per_batch,
            "shard_size": shard_size,
            "device": torch.device(device).type,
            "versions": _versions(),
        }
        failure = None
        if workers.is_main:
            try:
                store.prepare(output, settings, overwrite, plan)
            except UserError as error:
                failure = str(error)
        # Rank 0's settings are the run's (a model copied to another machine has other file times).
        views = workers.gather([(failure, scan.fingerprint, settings)])
        failures = [view[0] for view in views if view[0]]
        if failures:
            raise UserError(failures[0])
        if len({view[1] for view in views}) > 1:
            raise UserError("the processes read different documents from the input: give every one the same")
        settings = views[0][2]
        key = store.fingerprint(settings)
        share = plan[workers.rank :: workers.count]
        # Every shard of this process's share on disk is read and its checksum recomputed: a damaged one
        # is embedded again.
        spans = dict(zip(plan, scan.spans, strict=True))
        done, damaged, truncated = store.complete_shards(output, key, share, spans)
        mine = [index for index in range(workers.rank, len(plan), workers.count) if plan[index] not in done]
        began = time.perf_counter()
        documents, tokens, written = _run_shards(
            encoder.model, source, scan.documents, mine, shard_size, max_tokens_per_batch, max_length, key,
            output, progress, len(done),
        )  # fmt: skip
        seconds = time.perf_counter() - began
        checksums = {**done, **{name: checksum for name, (checksum, _) in written.items()}}
        truncated.update({name: count for name, (_, count) in written.items()})
        parts = workers.gather([(seconds, documents, tokens, checksums, done, damaged, truncated)])
        if workers.state is not None:
            workers.state.wait_for_everyone()
        return _finish(workers.is_main, output, plan, scan, settings, encoder, parts)


def _versions() -> dict[str, str | None]:
    from bert_cluster import environment

    names = ("torch", "transformers", "sentence-transformers", "bert-cluster")
    return {name: environment.package_version(name) for name in names}


def _shards(
    documents: Iterator[Document], total: int, shard_size: int, wanted: list[int]
) -> Iterator[tuple[int, list[Document]]]:
    """``(index, documents)`` of each shard in ``wanted`` (ascending), reading ``documents`` as they come.

    The documents of the other shards are read past, not kept; reading stops after the last one wanted.

    Raises:
        UserError: the input holds fewer documents than its first pass counted (it changed meanwhile).
    """
    position = 0
    for index in wanted:
        skip = index * shard_size - position
        if skip:
            position += sum(1 for _ in itertools.islice(documents, skip))
        expected = min(shard_size, total - index * shard_size)
        shard = list(itertools.islice(documents, expected))
        position += len(shard)
        if len(shard) != expected:
            raise UserError(
                f"the input changed while it was read: {position} documents where its first pass counted "
                f"{total}; run again on an input that stays as it is"
            )
        yield index, shard


def _run_shards(
    model: Any,
    source: Input,
    total: int,
    wanted: list[int],
    shard_size: int,
    budget: int,
    max_length: int,
    key: str,
    output: Path,
    progress: Progress | None,
    complete: int = 0,
) -> tuple[int, int, dict[str, tuple[str, int]]]:
    """Read, tokenise, encode and write the shards ``wanted`` of ``source``'s ``total`` documents, in turn.

    ``complete`` more of this share are on disk already. Returns the documents and tokens embedded and
    each written shard's checksum and truncated documents.
    """
    import torch

    total_documents = sum(min(shard_size, total - index * shard_size) for index in wanted)
    documents = tokens = 0
    counted_documents = counted_tokens = 0  # tokenised so far: they give the estimate of the tokens to do

    def tokens_to_do() -> int:
        if not counted_documents:
            return 0
        return counted_tokens + round(
            (total_documents - counted_documents) * counted_tokens / counted_documents
        )

    def advance(batch_documents: int, batch_tokens: int) -> None:
        nonlocal documents, tokens
        documents += batch_documents
        tokens += batch_tokens
        if progress is not None:
            progress(documents, tokens, total_documents, tokens_to_do())

    if progress is not None:
        progress(0, 0, total_documents, 0)
    lowercase = bool(getattr(model[0], "do_lower_case", False))
    written: dict[str, tuple[str, int]] = {}
    stream = source.documents()
    try:
        with torch.inference_mode():
            for index, shard_documents in _shards(stream, total, shard_size, wanted):
                counts = count_tokens(
                    model.tokenizer, [document.text for document in shard_documents], lowercase
                )
                lengths = [min(count, max_length) for count in counts]
                positions = range(len(shard_documents))
                shard = Shard(index, positions, tuple(batches_within(lengths, positions, budget)))
                counted_documents += len(shard_documents)
                counted_tokens += sum(lengths)
                vectors = _encode_shard(model, shard, shard_documents, lengths, advance)
                table = _shard_table(shard_documents, counts, vectors, max_length, key)
                checksum = store.write_shard(output, shard.name, table)[1]
                written[shard.name] = (checksum, sum(count > max_length for count in counts))
            if wanted:  # the rest of the input, read for its hash: a change after the last shard shows too
                collections.deque(stream, maxlen=0)
    except KeyboardInterrupt:
        raise EmbedInterrupted(output, complete + len(written), complete + len(wanted)) from None
    except InputChanged as error:  # each shard is checked before it is written: those on disk are sound
        raise UserError(
            f"{error}; the {complete + len(written)} shard(s) written before stay in {output}: once the "
            "input stays as it is, run again with --overwrite"
        ) from None
    finally:
        stream.close()  # a file left open by a reader that stopped early
    return documents, tokens, written


def _finish(
    is_main: bool,
    output: Path,
    plan: list[str],
    scan: Scan,
    settings: dict[str, Any],
    encoder: Any,
    parts: list[tuple[float, int, int, dict[str, str], dict[str, str], dict[str, str], dict[str, int]]],
) -> EmbedResult:
    """The result on every process; rank 0 writes the manifest, after every shard is on disk.

    ``parts``: each process's seconds, documents, tokens, checksums (name: sha256), resumed shards,
    damaged shards (name: why) and truncated documents (name: how many) of its share.
    """
    from bert_cluster.reports import environment

    seconds = max((part[0] for part in parts), default=0.0)
    documents = sum(part[1] for part in parts)
    tokens = sum(part[2] for part in parts)
    checksums = {name: checksum for part in parts for name, checksum in part[3].items()}
    resumed = {name for part in parts for name in part[4]}
    damaged = {name: why for part in parts for name, why in part[5].items()}
    truncated = sum(count for part in parts for count in part[6].values())
    dimension = encoder.model.get_embedding_dimension()
    manifest_file = output / store.MANIFEST
    rate = (lambda amount: amount / seconds) if documents and seconds > 0 else (lambda amount: None)
    manifest = {
        "fingerprint": store.fingerprint(settings),
        "model": {"path": encoder.path, **encoder.modules, "positions": encoder.positions},
        "settings": {key: value for key, value in settings.items() if key not in ("model", "versions")},
        "environment": environment(settings["device"], len(parts)) if is_main else {},
        "versions": settings["versions"],
        "processes": len(parts),
        "dimension": dimension,
        "counts": {
            "documents": scan.documents + len(scan.problems),
            "embedded": scan.documents,
            "truncated": truncated,
            "problems": len(scan.problems),
        },
        "problems": [problem.to_dict() for problem in scan.problems],
        "shards": list(plan),
        "checksums": {name: checksums[name] for name in plan},
        "this_run": {
            "shards_written": len(plan) - len(resumed),
            "shards_resumed": len(resumed),
            "shards_damaged": damaged,
            "documents": documents,
            "tokens": tokens,
            "seconds": seconds,
            "documents_per_second": rate(documents),
            "tokens_per_second": rate(tokens),
        },
    }
    if is_main:
        if manifest_file.is_file() and len(resumed) == len(plan):
            with contextlib.suppress(OSError, ValueError):
                import json

                earlier = json.loads(manifest_file.read_text(encoding="utf-8"))
                if earlier.get("fingerprint") == manifest["fingerprint"]:
                    manifest = earlier  # already complete: keep the run that did the work
        store.write_json(manifest_file, manifest)
    run = manifest["this_run"]
    return EmbedResult(
        output=output,
        documents=scan.documents,
        truncated=truncated,
        problems=list(scan.problems),
        shards=len(plan),
        resumed_shards=len(resumed),
        dimension=dimension,
        seconds=run["seconds"],
        documents_per_second=run["documents_per_second"],
        tokens_per_second=run["tokens_per_second"],
        manifest=manifest,
        damaged_shards=damaged,
    )
