"""``min_length="auto"``: the row length from which clustered attention beats torch's SDPA, measured.

Clustering has a fixed cost (hashing, K-means, C centroid rows over all keys, the top-k products) that
exact attention does not; below some row length N exact attention is faster. That length depends on
the backend and the machine, so it is measured, once per

    (backend, the CPU kernels' ISA, device model, torch and bert-cluster versions, threads, heads, head
     dims, dtype, settings)

and kept in a JSON file in the user cache folder (``$BERT_CLUSTER_CACHE_DIR``, else
``$XDG_CACHE_HOME/bert-cluster``, else ``~/.cache/bert-cluster``), so every later process reuses it.
If the folder cannot be written the figure is kept in memory for the process.

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

import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bert_cluster.config import ClusteredAttentionConfig

CACHE_ENV = "BERT_CLUSTER_CACHE_DIR"
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

logger = logging.getLogger(__name__)
_MEMORY: dict[str, int] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """The folder of the cache file."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bert-cluster"


def _device_model(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def facts(backend: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, config) -> dict:
    """What the crossover depends on: the cache key."""
    from bert_cluster import __version__, ops

    return {
        "backend": backend.name,
        # the CPU kernel library's ISA: AVX2 and AVX-512 kernels cross over at different lengths
        "kernels": ops.load_kernels().get("cpu_isa") if backend.name == "cpu" else None,
        "device": _device_model(query.device),
        "torch": str(torch.__version__),
        "bert_cluster": __version__,
        "threads": torch.get_num_threads(),
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
) -> int:
    """Rows shorter than this run exact attention: measured on first use, then read from the cache."""
    entry = facts(backend, query, key, value, config)
    name = json.dumps(entry, sort_keys=True)
    found = _MEMORY.get(name)
    if found is not None:
        return found
    with _LOCK:
        if name in _MEMORY:
            return _MEMORY[name]
        path = cache_dir() / CACHE_FILE
        stored = _read(path)
        if name in stored and isinstance(stored[name].get("min_length"), int):
            _MEMORY[name] = stored[name]["min_length"]
            return _MEMORY[name]
        result = measure(backend, query, key, value, config, scaling)
        _MEMORY[name] = result["min_length"]
        if not result.get("stable", True):
            logger.warning(
                "bert-cluster: the crossover measurement was noisy (a busy machine?); min_length=%d for "
                "this process, measured again next time",
                result["min_length"],
            )
            return _MEMORY[name]
        stored = _read(path)  # another process may have written meanwhile
        stored[name] = {**result, "facts": entry}
        _write(path, stored)
        return _MEMORY[name]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        temporary.replace(path)  # atomic: a reader sees the old file or the new one
    except OSError as error:
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
) -> dict[str, Any]:
    """Time SDPA and the clustered path on one random row per length; the crossover and the timings."""
    from bert_cluster.attention import _clustered

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

            def clustered(q=q, k=k, v=v, valid=valid, clusters=clusters, topk=topk):
                return _clustered(backend, q, k, v, valid, config, clusters, topk, scaling, 0)

            times: dict[str, list[float]] = {"sdpa": [], "clustered": []}
            sdpa(), clustered()  # warm-up
            for _ in range(REPEATS):
                for label, fn in (("sdpa", sdpa), ("clustered", clustered)):
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
