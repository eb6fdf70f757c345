"""Attention cost by sequence length: torch SDPA, eager attention, and (i-)clustered attention on the
reference and on the compiled kernels. Prints a table and writes JSON.

Time: median over interleaved repeats (every method once per round, so load drifts hit all alike).
Memory (CPU): the peak resident set (VmHWM) of a fresh subprocess per case, minus its peak right
before the call (inputs allocated, kernels loaded, warmed up on a tiny input): what one call adds at its
peak. On CUDA (--device cuda): torch.cuda.max_memory_allocated over one call, minus what was allocated.

    python scripts/bench_attention.py --threads 2 --output results/bench_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

METHODS = ("sdpa", "eager", "ref-i-clustered", "ref-clustered", "kernel-i-clustered", "kernel-clustered")
SETTINGS = {"clusters": 25, "topk": 32, "bits": 63, "iterations": 10}


def make_call(method: str, n: int, heads: int, head_dim: int, device: str = "cpu"):
    """The inputs and a zero-argument function running ``method`` once on them."""
    import torch

    from bert_cluster import ClusteredAttentionConfig, clustered_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=generator).to(device) for _ in range(3))
    scaling = 1.0 / math.sqrt(head_dim)
    if method == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if method == "eager":
        return lambda: torch.softmax((q @ k.transpose(-1, -2)) * scaling, dim=-1) @ v
    backend, mode = method.split("-", 1)
    config = ClusteredAttentionConfig(
        **SETTINGS, mode=mode, backend="reference" if backend == "ref" else device
    )
    return lambda: clustered_attention(q, k, v, config=config)


def _peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that across fork and exec,
    so a child started by a big parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def memory_case(method: str, n: int, heads: int, head_dim: int, threads: int) -> float:
    """Run in a fresh interpreter: MiB the call adds to the process's peak RSS."""
    import torch

    torch.set_num_threads(threads)
    with torch.inference_mode():
        make_call(method, 16, heads, head_dim)()  # load kernels, initialise threads/allocator
        call = make_call(method, n, heads, head_dim)
        before = _peak_rss_kib()
        call()
        after = _peak_rss_kib()
    return (after - before) / 1024.0


def measure_memory(method: str, n: int, args) -> float:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import bench_attention as b; "
        "print(b.memory_case(sys.argv[2], *map(int, sys.argv[3:7])))"
    )
    argv = [
        str(Path(__file__).parent),
        method,
        str(n),
        str(args.heads),
        str(args.head_dim),
        str(args.threads),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def time_all(lengths, args) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], float]]:
    """Interleaved timings; on CUDA also the peak allocated memory per case (torch.cuda statistics)."""
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[tuple[str, int], list[float]] = {}
    peaks: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for n in lengths:
            methods = [m for m in args.methods if not (m.startswith("ref") and n > args.max_reference_n)]
            calls = {m: make_call(m, n, args.heads, args.head_dim, args.device) for m in methods}
            for method, call in calls.items():
                call()  # warm-up
                if cuda:
                    sync()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    call()
                    sync()
                    peaks[(method, n)] = (torch.cuda.max_memory_allocated() - base) / 2**20
            for _ in range(args.repeats):
                for method, call in calls.items():
                    sync()
                    start = time.perf_counter()
                    call()
                    sync()
                    times.setdefault((method, n), []).append(time.perf_counter() - start)
            print(f"  timed N={n}", file=sys.stderr)
    return times, peaks


def render(rows: list[dict]) -> None:
    headers = ["N", "method", "median ms", "x SDPA speed", "peak MiB"]
    lines = [
        [
            str(r["n"]),
            r["method"],
            f"{r['median_ms']:.2f}",
            f"{r['speedup_vs_sdpa']:.2f}",
            "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}",
        ]
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="attention, batch 1, fp32 (speed: SDPA time / method time)")
        for header in headers:
            table.add_column(header, justify="right" if header != "method" else "left")
        for line in lines:
            table.add_row(*line)
        Console().print(table)
    except ImportError:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--max-reference-n", type=int, default=4096, help="skip the slow reference above this N"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory subprocesses")
    parser.add_argument("--output", type=Path, default=Path("results/bench_attention.json"))
    args = parser.parse_args()

    import torch

    from bert_cluster import _loader

    info = _loader.build_info()
    if "kernel" in " ".join(args.methods) and not info["kernels_loaded"]:
        parser.error(f"the kernels are not available: {info['kernels_reason']}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a visible CUDA GPU")
    times, cuda_peaks = time_all(args.lengths, args)
    rows = []
    for n in args.lengths:
        sdpa = statistics.median(times[("sdpa", n)]) if ("sdpa", n) in times else float("nan")
        for method in args.methods:
            if (method, n) not in times:
                continue
            median = statistics.median(times[(method, n)])
            if args.device == "cuda":
                peak = cuda_peaks.get((method, n))
            else:
                peak = None if args.no_memory else measure_memory(method, n, args)
            rows.append(
                {
                    "n": n,
                    "method": method,
                    "median_ms": median * 1e3,
                    "times_ms": [t * 1e3 for t in times[(method, n)]],
                    "speedup_vs_sdpa": sdpa / median,
                    "peak_mib": peak,
                }
            )
        print(f"  memory N={n}", file=sys.stderr)
    render(rows)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": _cpu_model(), "threads": args.threads},
        "torch": str(torch.__version__),
        "kernels": {k: info[k] for k in ("kernels_loaded", "kernels_reason", "compiler")},
        "device": args.device,
        "shape": {"batch": 1, "heads": args.heads, "head_dim": args.head_dim, "dtype": "float32"},
        "settings": SETTINGS,
        "timing": f"median of {args.repeats} interleaved repeats after one warm-up",
        "memory": (
            "peak torch.cuda allocated memory added by one call (max_memory_allocated)"
            if args.device == "cuda"
            else "peak RSS (VmHWM) added by one call, fresh subprocess per case"
        ),
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
