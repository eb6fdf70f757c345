"""``min_length="auto"``: the row length from which clustered attention beats torch's SDPA, measured.

Clustering has a fixed cost (hashing, K-means, C centroid rows over all keys, the top-k products) that
exact attention does not; below some row length N exact attention is faster. That length depends on
the backend and the machine, so it is measured, once per

    (backend, the CPU kernels' ISA, device model, torch and bert-cluster versions, threads, heads, head
     dims, dtype, settings)

and kept in a JSON file in the user cache folder (``$BERT_CLUSTER_CACHE_DIR``, else
``$XDG_CACHE_HOME/bert-cluster``, else ``~/.cache/bert-cluster``), so every later process reuses it.
If the folder cannot be written the figure is kept in memory for the process.

Several processes starting at once (data-parallel workers, a test run) measure once between them: the
one that takes the file lock beside the cache measures (alone, so that the others' work does not spoil
its timings) and writes the figure; the others wait for the lock, read that figure and use it. A lock
that cannot be had within ``LOCK_TIMEOUT_S`` (or at all: a read-only folder) never blocks a process: it
measures for itself. The file is replaced atomically, and one that is not valid JSON is ignored and
rewritten.

How it is measured: one row (batch 1, the caller's heads, head dims and dtype; random inputs, which
make K-means run its full iteration count: the slow case) at growing lengths ``LENGTHS``; at each, the
fastest of ``REPEATS`` interleaved runs of SDPA and of the clustered path (the minimum, not the median:
on a busy machine every run is delayed by others, never sped up, so the minimum is the least noisy).
The crossover is the first length at which clustering takes at most ``MARGIN`` of SDPA's time there and
at the next length (two in a row, so that one noisy win does not count). If the time ``BUDGET_S`` runs
out first, the crossover is extrapolated from the last length measured: SDPA grows as N^2 and
clustering as N, so their ratio shrinks as 1/N.

A busy machine spoils such a measurement (the clustered path has several parallel regions, and each
waits for a descheduled thread): when the repeats of a length spread by more than ``STABLE_SPREAD``
(median over minimum), the figure is used for this process only and not cached, so that a later, quieter
process measures again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import filelock
import torch

from bert_cluster import environment
from bert_cluster.config import ClusteredAttentionConfig

CACHE_ENV = environment.CACHE_DIR
#: v2: the CPU kernels run a call as one op (clustered_heads), which moved the crossover (v1 is stale).
#: v3: their top-k and K-means got faster (the same results), which moves it again.
#: v4: fp16/bf16 calls widen each head once instead of in every step (faster in those dtypes).
CACHE_FILE = "crossover-v4.json"
#: Row lengths tried, shortest first.
LENGTHS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
#: Clustering counts as faster when it takes at most this share of SDPA's time (a safety margin, so
#: that a patched model is not slower than the unmodified one where the two are close). At 0.9 the CPU
#: kernels' crossover for all-MiniLM-L6-v2 fell at 384 tokens, where the whole model ran at 0.96x / 0.99x
#: of SDPA's speed (batch 1 / 8): attention is a small share of a forward pass there, and a 10% cheaper
#: attention is lost in the run-to-run spread. At 0.75 it is 512 tokens, where the model ran 1.05-1.10x.
MARGIN = 0.75
#: Seconds a measurement may take before the crossover is extrapolated.
BUDGET_S = 4.0
REPEATS = 7
#: Median over minimum of a length's repeats above which a measurement is too noisy to cache.
STABLE_SPREAD = 1.5
#: Seconds a process waits for another one's measurement (one takes BUDGET_S plus one length: ~5 s)
#: before it measures for itself.
LOCK_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)
_MEMORY: dict[str, int] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """The folder of the cache file (``bert_cluster.environment.cache_dir``)."""
    return environment.cache_dir()


def stored() -> dict[str, int]:
    """The crossovers stored in this machine's cache file, by what each was measured for (its facts as JSON).

    What a benchmark of ``min_length="auto"`` records beside its timings; a file that cannot be read, or
    an entry without a valid figure, counts as none.
    """
    stored = _read(cache_dir() / CACHE_FILE)
    return {name: found for name in stored if (found := _cached(stored, name)) is not None}


def facts(backend: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, config) -> dict:
    """What the crossover depends on: the cache key."""
    from bert_cluster import ops

    return {
        "backend": backend.name,
        # the CPU kernel library's ISA: AVX2 and AVX-512 kernels cross over at different lengths
        "kernels": ops.load_kernels().get("cpu_isa") if backend.name == "cpu" else None,
        "device": environment.device_name(query.device),
        "torch": str(torch.__version__),
        "bert_cluster": environment.bert_cluster_version(),
        "threads": environment.threads(),
        "heads": query.shape[1],
        "head_dim": query.shape[-1],
        "value_dim": value.shape[-1],
        "dtype": str(query.dtype).removeprefix("torch."),
        "settings": {
            name: getattr(config, name)
            for name in ("clusters", "topk", "bits", "iterations", "mode", "cluster_growth", "topk_growth")
        },
    }


def min_length(
    backend: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    config: ClusteredAttentionConfig,
    scaling: float,
    clustered: Callable[..., torch.Tensor],
) -> int:
    """Rows shorter than this run exact attention: measured on first use, then read from the cache.

    ``clustered`` is the clustered path to time (``attention._clustered``), passed in by its caller.
    """
    entry = facts(backend, query, key, value, config)
    name = json.dumps(entry, sort_keys=True)
    found = _MEMORY.get(name)
    if found is not None:
        return found
    with _LOCK:
        if name in _MEMORY:
            return _MEMORY[name]
        path = cache_dir() / CACHE_FILE
        found = _cached(_read(path), name)
        if found is None:
            with _file_lock(path):
                found = _cached(_read(path), name)  # measured by another process while this one waited
                if found is None:
                    found = _measure_and_store(
                        path, name, entry, backend, query, key, value, config, scaling, clustered
                    )
        _MEMORY[name] = found
        return found


def _cached(stored: dict, name: str) -> int | None:
    record = stored.get(name)
    found = record.get("min_length") if isinstance(record, dict) else None
    return found if isinstance(found, int) and not isinstance(found, bool) and found >= 0 else None


def _measure_and_store(path, name, entry, backend, query, key, value, config, scaling, clustered) -> int:
    """Measure, and cache the figure unless the measurement was noisy; the figure."""
    result = measure(backend, query, key, value, config, scaling, clustered)
    if not result.get("stable", True):
        logger.warning(
            "bert-cluster: the crossover measurement was noisy (a busy machine?); min_length=%d for "
            "this process, measured again next time",
            result["min_length"],
        )
        return result["min_length"]
    stored = _read(path)  # written by another process meanwhile, if it could not have the lock
    stored[name] = {**result, "facts": entry}
    _write(path, stored)
    return result["min_length"]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """The inter-process lock beside the cache file, held for the block if it can be had in time.

    Never raises and never waits more than ``LOCK_TIMEOUT_S``: without the lock (a timeout, a read-only
    or unusable folder) the block runs unlocked, which costs at most a second measurement.
    """
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(path.with_name(path.name + ".lock"), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except (filelock.Timeout, OSError) as error:
        logger.info("bert-cluster: measuring the crossover without the cache lock (%s)", error)
        lock = None
    try:
        yield lock is not None
    finally:
        if lock is not None:
            lock.release()


def _read(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        logger.warning("bert-cluster: the crossover cache %s is not valid JSON; it will be rewritten", path)
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        temporary.replace(path)  # atomic: a reader sees the old file or the new one
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        logger.info("bert-cluster: cannot write the crossover cache %s (%s); kept in memory", path, error)


def _timer(device: torch.device):
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


def measure(
    backend: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    config: ClusteredAttentionConfig,
    scaling: float,
    clustered: Callable[..., torch.Tensor],
) -> dict[str, Any]:
    """Time SDPA and the clustered path on one random row per length; the crossover and the timings.

    ``clustered`` has the signature of ``attention._clustered`` (this module does not import attention,
    which imports it).
    """
    heads, dk, dv = query.shape[1], query.shape[-1], value.shape[-1]
    device, dtype = query.device, query.dtype
    now = _timer(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    start, timings = time.perf_counter(), []
    with torch.no_grad():
        for n in LENGTHS:
            clusters, topk = config.row_settings(n)
            if n <= clusters:
                continue  # exact attention anyway
            q, k = (torch.randn(1, heads, n, dk, generator=generator).to(device, dtype) for _ in range(2))
            v = torch.randn(1, heads, n, dv, generator=generator).to(device, dtype)
            valid = torch.ones(1, n, dtype=torch.bool, device=device)

            def sdpa(q=q, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling)

            def approximate(q=q, k=k, v=v, valid=valid, clusters=clusters, topk=topk):
                return clustered(backend, q, k, v, valid, config, clusters, topk, scaling, 0)

            times: dict[str, list[float]] = {"sdpa": [], "clustered": []}
            sdpa(), approximate()  # warm-up
            for _ in range(REPEATS):
                for label, fn in (("sdpa", sdpa), ("clustered", approximate)):
                    begin = now()
                    fn()
                    times[label].append(now() - begin)
            exact_s, clustered_s = min(times["sdpa"]), min(times["clustered"])
            spread = max(statistics.median(t) / min(t) for t in times.values())
            timings.append({"length": n, "sdpa_s": exact_s, "clustered_s": clustered_s, "spread": spread})
            if _two_wins(timings) or time.perf_counter() - start > BUDGET_S:
                break
    crossover = crossover_from(timings)
    return {
        "min_length": int(crossover or 0),
        "stable": all(t["spread"] <= STABLE_SPREAD for t in timings),
        "timings": timings,
        "seconds": round(time.perf_counter() - start, 3),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _wins(timings: list[dict]) -> list[bool]:
    return [t["clustered_s"] <= MARGIN * t["sdpa_s"] for t in timings]


def _two_wins(timings: list[dict]) -> bool:
    wins = _wins(timings)
    return len(wins) >= 2 and wins[-1] and wins[-2]


def crossover_from(timings: list[dict]) -> int:
    """The crossover length from timings by increasing length (see the module docstring)."""
    if not timings:
        return 0
    wins = _wins(timings)
    for index in range(len(timings) - 1):
        if wins[index] and wins[index + 1]:
            return timings[index]["length"]
    last = timings[-1]
    if wins[-1]:
        return last["length"]
    # SDPA grows as N^2 and clustering as N: their ratio reaches MARGIN at about N * ratio / MARGIN.
    return math.ceil(last["length"] * last["clustered_s"] / last["sdpa_s"] / MARGIN)


def clear_memory() -> None:
    """Forget the figures read or measured in this process (the cache file stays)."""
    with _LOCK:
        _MEMORY.clear()


def measured() -> list[dict[str, Any]]:
    """The crossovers this process has measured or read from the cache: their facts and ``min_length``.

    Without the lock (a measurement holds it for seconds): a copy of the dict is one atomic step.
    """
    return [{**json.loads(name), "min_length": value} for name, value in dict(_MEMORY).items()]
