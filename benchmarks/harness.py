"""What the benchmarks share: timing rounds, the load average, the environment a run records, memory probes,
the long documents they embed, and how a benchmark starts itself in a fresh process.

Only the standard library is imported here at module level: ``benchmarks.peers`` runs its peers' workers
in another virtual environment (``.venv-peers``, without this project's transformers), which imports this
module too. The package and torch are imported inside the functions that need them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: The repository root (this folder's parent): a benchmark's children import ``benchmarks`` from here.
ROOT = Path(__file__).resolve().parent.parent
#: Environment of the processes that measure peak memory. glibc raises its mmap threshold (up to 32 MiB)
#: each time a large block is freed; from then on freed activations of a long document (25 MiB each at 16k
#: tokens for MiniLM) stay in the heap and count in the resident set, more or less from run to run: one
#: forward of minilm-l6-16k at 16,384 tokens peaked between 397 and 520 MiB above its start over five
#: runs, patched or not. With the threshold fixed at glibc's initial 128 KiB both peaked at 321 MiB.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
#: The kernels' facts (``bert_cluster.info()``) that ``environment()`` lifts to its top level.
KERNEL_FACTS = ("kernels_loaded", "kernels_reason", "compiler", "kernels_cpu_isa", "auto_backend_cpu")
ORDERS = ("interleaved", "alternating", "blocked")


# --- where a run ran -------------------------------------------------------------------------------------


def environment(threads: int | None = None) -> dict[str, Any]:
    """The package's own report (``bert_cluster.reports.environment``: versions, hardware, kernels, git hash,
    date), with the facts the tables read at its top level: ``date``, ``processor``, ``threads`` (the
    run's setting; default torch's), ``torch``, ``torch_cpu_capability`` (torch's own ISA) and the kernels'
    ``KERNEL_FACTS``."""
    import torch

    from bert_cluster import reports

    report = reports.environment()
    kernels = report["kernels"] if isinstance(report["kernels"], dict) else {}
    return {
        **report,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "transformers": report["packages"].get("transformers"),
        "bert_cluster": report["packages"].get("bert-cluster"),
        "platform": report["hardware"]["platform"],
        "processor": report["hardware"]["cpu"],
        "cpu_count": report["hardware"]["cpu_count"],
        "threads": torch.get_num_threads() if threads is None else threads,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **{key: kernels.get(key) for key in KERNEL_FACTS},
    }


def package_versions(names: Iterable[str]) -> dict[str, str]:
    """Python's and each installed package's version, in whichever environment runs it (a peer's too)."""
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none): how busy the machine was."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# --- timing ----------------------------------------------------------------------------------------------


def time_rounds(
    calls: Mapping[str, Callable[[], Any]],
    repeats: int,
    order: str = "interleaved",
    sync: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each call, ``repeats`` times (warm-ups are the caller's).

    ``interleaved``: every call once per round, so that load drifts hit all alike; ``alternating``: the
    same with the order reversed every other round; ``blocked``: each call's repeats back to back (on a
    virtual machine that deschedules idle vCPUs, a short call after another's long one can wait for its
    threads). ``sync`` runs before and after each call (``torch.cuda.synchronize`` on a GPU).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    names = list(calls)
    if order == "blocked":
        schedule = [name for name in names for _ in range(repeats)]
    else:
        schedule = [
            name
            for round_ in range(repeats)
            for name in (names[::-1] if order == "alternating" and round_ % 2 else names)
        ]
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in schedule:
        if sync is not None:
            sync()
        began = time.perf_counter()
        calls[name]()
        if sync is not None:
            sync()
        times[name].append(time.perf_counter() - began)
    return times


# --- tables ----------------------------------------------------------------------------------------------
# The Markdown of the README's and docs' tables (``benchmarks.render``): each benchmark renders its own
# results files with these.


def ms(value: float) -> str:
    """A time in milliseconds at about three significant digits."""
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def times(value: float) -> str:
    """A speed ratio: two decimals below 10, one above."""
    return f"{value:.2f}×" if value < 10 else f"{value:.1f}×"


def signed(value: float) -> str:
    """A change in points, with its sign."""
    return f"{value:+.2f}"


def tokens(n: int) -> str:
    """A token count with thousands separators."""
    return f"{n:,}"


def mean_std(values: Sequence[float]) -> str:
    """Mean ± sample std of a change in points (the std only with two or more values)."""
    if len(values) < 2:
        return signed(values[0])
    return f"{signed(statistics.mean(values))} ± {statistics.stdev(values):.2f}"


def mean_std_plain(values: Sequence[float]) -> str:
    """Mean ± sample std of a size (unsigned; the std only with two or more values)."""
    if len(values) < 2:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def runs(count: int) -> str:
    """ "one run" or "N runs"."""
    return "one run" if count == 1 else f"{count} runs"


def joined(values: Sequence[str]) -> str:
    """Figures of several runs in one cell: "a / b"."""
    return " / ".join(values)


def table_lines(header: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table; ``align`` holds 'l' or 'r' per column."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


# --- memory ----------------------------------------------------------------------------------------------


def memory_status() -> dict[str, float]:
    """The process's resident set now (``VmRSS``) and its peak so far (``VmHWM``), MiB (Linux)."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(("VmHWM:", "VmRSS:")):
                found[line[:5]] = int(line.split()[1]) / 1024
    if len(found) != 2:
        raise RuntimeError("no VmHWM/VmRSS in /proc/self/status (Linux only)")
    return found


def release_free_memory() -> bool:
    """Hand the allocator's free memory back to the system (glibc's ``malloc_trim``), where there is one.

    Without it the resident set before a forward includes freed blocks the forward then reuses, so that
    "the forward's own" memory reads 0 for one process and 12 MiB for the next (minilm-l6-16k, 2,048
    tokens: which blocks were free, and where, depends on what loading the model left behind).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError, TypeError):
        return False


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set (``5`` to /proc/self/clear_refs, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def tensor_peak_bytes(run: Callable[[], Any]) -> int:
    """The peak of the bytes held by CPU tensors while ``run()`` runs, above those held when it began."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        if event.device_type() == DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


# --- inputs ----------------------------------------------------------------------------------------------


def squad_dev() -> dict[str, Any]:
    """The SQuAD v1.1 dev file bert-cluster ships: ``paragraphs`` (id, context) and ``questions``."""
    from bert_cluster.datafiles import PACKAGE_DATA

    with gzip.open(PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz", "rt", encoding="utf-8") as handle:
        return json.load(handle)


def squad_articles() -> list[str]:
    """The 48 SQuAD v1.1 dev articles as the long-document task builds them (packaged paragraphs joined)."""
    from bert_cluster.tasks.kinds.long_retrieval import articles_from_paragraphs

    document = squad_dev()
    return articles_from_paragraphs(document["paragraphs"], document["questions"]).documents


def joined_articles(articles: list[str], document: int) -> str:
    """Document ``document`` of a long-input run: every article, joined from a different first one."""
    start = (document * 7) % len(articles)
    return "\n\n".join(articles[start:] + articles[:start])


# --- processes -------------------------------------------------------------------------------------------


def module_command(module: str, python: str | None = None) -> list[str]:
    """The command that runs benchmark ``module`` (``benchmarks.NAME``) in a fresh interpreter."""
    return [python or sys.executable, "-m", module]


def module_env(**variables: str) -> dict[str, str]:
    """This process's environment with ``variables`` set, and the repository on ``PYTHONPATH``, so that a
    child started by ``module_command`` finds ``benchmarks`` wherever it was started from."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **variables, "PYTHONPATH": path}


def run_worker(module: str, job: dict[str, Any], timeout: float | None, **variables: str) -> dict[str, Any]:
    """``python -m module --worker JOB`` in a fresh process (``variables`` set in its environment): the last
    JSON line it prints, or ``{"error": ...}`` with its last line on stderr (or the timeout)."""
    command = [*module_command(module), "--worker", json.dumps(job)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=module_env(**variables), check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or [
            f"exit {done.returncode}"
        ]
        return {"error": tail[0][:300]}
    return json.loads(lines[-1])
