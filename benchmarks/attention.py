"""Attention cost by sequence length: torch SDPA, eager attention, and (i-)clustered attention on the
reference and on the compiled kernels. Prints a table and writes JSON.

Time: median over interleaved repeats (every method once per round, so load drifts hit all alike); the
JSON keeps every repeat, the spread (interquartile range over the median) of each case, and the load
average before and after, to say how noisy the machine was. "x SDPA" is SDPA's median over the method's,
measured in the same run. --order blocked times each method's repeats back to back instead: on a virtual
machine whose idle vCPUs the host deschedules, a short call that follows another method's long one can
wait milliseconds for its worker threads to run again, which interleaving charges to the short method
alone. Memory (CPU): the peak resident set (VmHWM) of a fresh subprocess per case, minus its peak right
before the call (inputs allocated, kernels loaded, warmed up on a tiny input): what one call adds at its
peak. On CUDA (--device cuda): torch.cuda.max_memory_allocated over one call.

Inputs: --batch rows of N tokens, or with --mixed a batch of 16 rows padded to N with lengths drawn
between N/8 and N (what an evaluation feeds: SDPA gets the padding mask, as transformers passes it);
--dtype fp32 or bf16 (the kernels widen bf16 in registers). The kernel methods force clustering on every
row (min_length=0): they measure the kernels, not the routing of short rows. Each other clustered mode
is also given as a cost ratio to i-clustered on the same backend (issue 13's budget for i-clustered+).

    python -m benchmarks.attention --threads 2 --output results/bench_attention.json
    python -m benchmarks.attention --mixed --dtype bf16 --lengths 512 --methods sdpa kernel-i-clustered
    python -m benchmarks.attention --lengths 8192 16384 32768 --methods sdpa kernel-i-clustered --repeats 3
    python -m benchmarks.attention --lengths 384 4096 --methods sdpa kernel-i-clustered kernel-i-clustered+
    python -m benchmarks.attention --growth --head-dim 32 --lengths 8192 --methods sdpa kernel-i-clustered+
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    environment,
    joined,
    load_average,
    memory_status,
    module_command,
    module_env,
    ms,
    runs,
    table_lines,
    time_rounds,
    times,
    tokens,
)

METHODS = (
    "sdpa",
    "eager",
    "ref-i-clustered",
    "ref-clustered",
    "ref-i-clustered+",
    "kernel-i-clustered",
    "kernel-clustered",
    "kernel-i-clustered+",
)
# Fixed C and k at every length (the settings of issue 12's targets); with --growth, C and k grow with the
# length as convert's defaults make them (also measured end to end by benchmarks.long_context and
# benchmarks.length_scaling).
SETTINGS = {
    "clusters": 25,
    "topk": 32,
    "bits": 63,
    "iterations": 10,
    "cluster_growth": 0.0,
    "topk_growth": 0.0,
}


def clustered_settings(growth: bool = False) -> dict:
    """SETTINGS, or with ``growth`` the growth of C and k of ``ClusteredAttentionConfig``'s defaults."""
    if not growth:
        return dict(SETTINGS)
    from bert_cluster import ClusteredAttentionConfig

    defaults = ClusteredAttentionConfig()
    return {**SETTINGS, "cluster_growth": defaults.cluster_growth, "topk_growth": defaults.topk_growth}


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
MIXED_ROWS = 16


def make_inputs(
    n: int,
    heads: int,
    head_dim: int,
    device: str = "cpu",
    dtype: str = "fp32",
    batch: int = 1,
    mixed: bool = False,
):
    """q, k, v (B, H, N, D) and the valid mask (B, N): full rows, or 16 padded rows of mixed lengths."""
    import torch

    generator = torch.Generator().manual_seed(0)
    rows = MIXED_ROWS if mixed else batch
    q, k, v = (
        torch.randn(rows, heads, n, head_dim, generator=generator).to(device, getattr(torch, DTYPES[dtype]))
        for _ in range(3)
    )
    if mixed:
        lengths = torch.randint(max(1, n // 8), n + 1, (rows,), generator=generator)
        lengths[0] = n
        valid = torch.arange(n)[None, :] < lengths[:, None]
    else:
        valid = torch.ones(rows, n, dtype=torch.bool)
    return q, k, v, valid.to(device)


def make_call(
    method: str,
    n: int,
    heads: int,
    head_dim: int,
    device: str = "cpu",
    dtype: str = "fp32",
    batch: int = 1,
    mixed: bool = False,
    growth: bool = False,
):
    """A zero-argument function running ``method`` once on the inputs of ``make_inputs``."""
    import torch

    from bert_cluster import ClusteredAttentionConfig, clustered_attention

    q, k, v, valid = make_inputs(n, heads, head_dim, device, dtype, batch, mixed)
    scaling = 1.0 / math.sqrt(head_dim)
    mask = valid[:, None, None, :] if mixed else None  # (B, 1, 1, N), as transformers' SDPA path passes it
    if method == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if method == "eager":

        def eager():
            scores = (q @ k.transpose(-1, -2)) * scaling
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            return torch.softmax(scores, dim=-1) @ v

        return eager
    backend, mode = method.split("-", 1)
    backend_name = "reference" if backend == "ref" else device
    config = ClusteredAttentionConfig(
        **clustered_settings(growth), mode=mode, min_length=0, backend=backend_name
    )
    return lambda: clustered_attention(q, k, v, valid, config=config)


def memory_case(
    method: str,
    n: int,
    heads: int,
    head_dim: int,
    threads: int,
    dtype: str,
    batch: int,
    mixed: int,
    growth: int,
) -> float:
    """Run in a fresh interpreter: MiB the call adds to the process's peak RSS (VmHWM; not ru_maxrss: Linux
    carries that across fork and exec, so a child started by a big parent would report the parent's)."""
    import torch

    torch.set_num_threads(threads)
    with torch.inference_mode():
        make_call(method, 16, heads, head_dim, "cpu", dtype)()  # load kernels, initialise threads/allocator
        call = make_call(method, n, heads, head_dim, "cpu", dtype, batch, bool(mixed), bool(growth))
        before = memory_status()["VmHWM"]
        call()
        after = memory_status()["VmHWM"]
    return after - before


def measure_memory(method: str, n: int, args) -> float:
    argv = [
        "--memory-case",
        method,
        str(n),
        str(args.heads),
        str(args.head_dim),
        str(args.threads),
        args.dtype,
        str(args.batch),
        str(int(args.mixed)),
        str(int(args.growth)),
    ]
    env = module_env(OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(
        [*module_command(__spec__.name), *argv], capture_output=True, text=True, env=env, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def time_all(lengths, args) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], float]]:
    """Interleaved timings; on CUDA also the peak allocated memory per case (torch.cuda statistics)."""
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    times: dict[tuple[str, int], list[float]] = {}
    peaks: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for n in lengths:
            methods = [m for m in args.methods if not (m.startswith("ref") and n > args.max_reference_n)]
            calls = {
                m: make_call(
                    m,
                    n,
                    args.heads,
                    args.head_dim,
                    args.device,
                    args.dtype,
                    args.batch,
                    args.mixed,
                    args.growth,
                )
                for m in methods
            }
            for method, call in calls.items():
                call()  # warm-up
                if cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    call()
                    torch.cuda.synchronize()
                    peaks[(method, n)] = (torch.cuda.max_memory_allocated() - base) / 2**20
            measured = time_rounds(calls, args.repeats, args.order, sync)
            times.update({(method, n): seconds for method, seconds in measured.items()})
            print(f"  timed N={n}", file=sys.stderr)
    return times, peaks


def render(rows: list[dict], title: str) -> None:
    headers = ["N", "method", "C, k", "median ms", "spread", "x SDPA speed", "peak MiB"]
    lines = [
        [
            str(r["n"]),
            r["method"],
            "-" if r["clusters_topk"] is None else "{}, {}".format(*r["clusters_topk"]),
            f"{r['median_ms']:.2f}",
            f"{r['spread']:.0%}",
            f"{r['speedup_vs_sdpa']:.2f}",
            "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}",
        ]
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for header in headers:
            table.add_column(header, justify="right" if header != "method" else "left", no_wrap=True)
        for line in lines:
            table.add_row(*line)
        console = Console()
        console.width = max(console.width, 100)  # a log or pipe gets 80 columns, which cut the method names
        console.print(table)
    except ImportError:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
        print(title)
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
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--batch", type=int, default=1, help="rows of N tokens each (no padding)")
    parser.add_argument(
        "--mixed", action="store_true", help=f"{MIXED_ROWS} padded rows of mixed lengths up to N instead"
    )
    parser.add_argument(
        "--growth",
        action="store_true",
        help="C and k grow with the length as convert's defaults do (default: C = 25, k = 32 at any N)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--order",
        choices=["interleaved", "blocked"],
        default="interleaved",
        help="every method once per round, or each method's repeats back to back",
    )
    parser.add_argument(
        "--max-reference-n", type=int, default=4096, help="skip the slow reference above this N"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory subprocesses")
    parser.add_argument("--output", type=Path, default=Path("results/bench_attention.json"))
    parser.add_argument("--memory-case", nargs=9, help=argparse.SUPPRESS)  # measure_memory's child
    args = parser.parse_args()
    if args.memory_case:
        method, n, heads, head_dim, threads, dtype, batch, mixed, growth = args.memory_case
        sizes = (int(n), int(heads), int(head_dim), int(threads))
        print(memory_case(method, *sizes, dtype, int(batch), int(mixed), int(growth)))
        return
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    import torch

    machine = environment(args.threads)
    if "kernel" in " ".join(args.methods) and not machine["kernels_loaded"]:
        parser.error(f"the kernels are not available: {machine['kernels_reason']}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a visible CUDA GPU")
    load_before = load_average()
    times, cuda_peaks = time_all(args.lengths, args)
    load_after = load_average()
    from bert_cluster import ClusteredAttentionConfig

    settings = ClusteredAttentionConfig(**clustered_settings(args.growth))
    rows = []
    for n in args.lengths:
        sdpa = statistics.median(times[("sdpa", n)]) if ("sdpa", n) in times else float("nan")
        for method in args.methods:
            if (method, n) not in times:
                continue
            median = statistics.median(times[(method, n)])
            quartiles = (
                statistics.quantiles(times[(method, n)], n=4) if len(times[(method, n)]) > 1 else [0, 0, 0]
            )
            if args.device == "cuda":
                peak = cuda_peaks.get((method, n))
            else:
                peak = None if args.no_memory else measure_memory(method, n, args)
            rows.append(
                {
                    "n": n,
                    "method": method,
                    "clusters_topk": settings.row_settings(n) if method not in ("sdpa", "eager") else None,
                    "median_ms": median * 1e3,
                    "times_ms": [t * 1e3 for t in times[(method, n)]],
                    "spread": (quartiles[2] - quartiles[0]) / median,
                    "speedup_vs_sdpa": sdpa / median,
                    "peak_mib": peak,
                    "cost_vs_i_clustered": _paired_ratio(times, method, n),
                }
            )
        print(f"  memory N={n}", file=sys.stderr)
    rows_desc = f"{MIXED_ROWS} padded rows of mixed lengths" if args.mixed else f"batch {args.batch}"
    title = (
        f"attention, {rows_desc}, {args.heads} heads x {args.head_dim}, {args.dtype}, {args.threads} threads "
        f"(x SDPA: SDPA time / method time; spread: IQR / median)"
    )
    render(rows, title)
    for row in rows:
        if row["cost_vs_i_clustered"] is not None:
            print(
                f"N={row['n']}: {row['method']} / its i-clustered = {row['cost_vs_i_clustered']:.3f} "
                "(median of per-round ratios)"
            )
    result = {
        "date": machine["date"],
        "machine": {
            **{key: machine[key] for key in ("platform", "processor", "threads")},
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "torch": machine["torch"],
        "kernels": {
            k: machine[k] for k in ("kernels_loaded", "kernels_reason", "compiler", "kernels_cpu_isa")
        },
        # torch's own ISA (ATEN_CPU_CAPABILITY lowers it, as BERT_CLUSTER_CPU_ISA lowers the kernels')
        "torch_cpu_capability": machine["torch_cpu_capability"],
        "environment": machine,
        "device": args.device,
        "shape": {
            "rows": MIXED_ROWS if args.mixed else args.batch,
            "mixed_lengths": args.mixed,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": DTYPES[args.dtype],
        },
        "settings": clustered_settings(args.growth),
        "timing": f"median of {args.repeats} {args.order} repeats after one warm-up",
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


def _paired_ratio(times, method: str, n: int) -> float | None:
    """``method``'s time over the same backend's i-clustered time, the median of per-round ratios (in the
    interleaved order each round runs both back to back, so load drifts cancel); None for the others."""
    backend, _, mode = method.partition("-")
    base = (f"{backend}-i-clustered", n)
    if mode in ("", "i-clustered") or (method, n) not in times or base not in times:
        return None
    return statistics.median(t / b for t, b in zip(times[(method, n)], times[base], strict=True))


# --- tables (benchmarks.render) ----------------------------------------------------------------------

#: The method names of this benchmark and their column headings.
HEADINGS = {
    "kernel-i-clustered": "i-clustered",
    "kernel-i-clustered+": "i-clustered+",
    "kernel-clustered": "clustered",
}


DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def attention_row(result: dict, n: int, method: str) -> dict | None:
    return next((r for r in result["rows"] if r["n"] == n and r["method"] == method), None)


def machine_line(result: dict) -> str:
    """CPU, kernel library (ISA) and torch's own CPU capability, as the run recorded them."""
    processor = result["machine"].get("processor", "?")
    isa = result["kernels"].get("kernels_cpu_isa", "one library (before the per-ISA builds)")
    capability = result.get("torch_cpu_capability")
    parts = [processor, f"kernels {isa}"]
    if capability:
        parts.append(f"torch {capability}")
    return ", ".join(parts)


def attention_caption(results: Sequence[dict]) -> str:
    first = results[0]
    shape = first["shape"]
    rows = f"{shape['rows']} padded rows of mixed lengths" if shape["mixed_lengths"] else "1 row"
    dates = sorted({r["date"][:10] for r in results})
    return (
        f"{machine_line(first)}; {first['machine']['threads']} threads; {rows}, {shape['heads']} heads × "
        f"{shape['head_dim']}; {first['timing']}; {runs(len(results))} of {', '.join(dates)}."
    )


def speed_table(
    results: list[dict], methods: Sequence[str], by_dtype: bool = True, with_settings: bool = False
) -> list[str]:
    """N (and dtype) per row, SDPA's and each method's median ms per run, "a / b" over runs."""
    groups: dict[str, list[dict]] = {}
    for result in results:
        groups.setdefault(DTYPE_LABELS[result["shape"]["dtype"]], []).append(result)
    header = ["N"] + (["dtype"] if by_dtype else []) + (["C, k"] if with_settings else [])
    header += ["SDPA ms"] + [f"{HEADINGS[m]} ms (× SDPA)" for m in methods]
    rows = []
    for dtype, group in groups.items():
        for n in sorted({r["n"] for r in group[0]["rows"]}):
            row = [tokens(n)] + ([dtype] if by_dtype else [])
            if with_settings:
                clusters, topk = attention_row(group[0], n, methods[0])["clusters_topk"]
                row.append(f"{clusters}, {topk}")
            row.append(joined([ms(attention_row(r, n, "sdpa")["median_ms"]) for r in group]))
            for method in methods:
                found = [attention_row(r, n, method) for r in group]
                if any(f is None for f in found):
                    row.append("")
                    continue
                row.append(
                    f"{joined([ms(f['median_ms']) for f in found])} "
                    f"({joined([times(f['speedup_vs_sdpa']) for f in found])})"
                )
            rows.append(row)
    align = ["r"] + (["l"] if by_dtype else []) + (["r"] if with_settings else [])
    align += ["r"] * (1 + len(methods))
    return table_lines(header, align, rows) + ["", attention_caption(results)]


def cost_table(results: list[dict]) -> list[str]:
    """i-clustered+ against i-clustered, back to back (the results' ``cost_vs_i_clustered``)."""
    (result,) = results
    rows = []
    for n in sorted({r["n"] for r in result["rows"]}):
        sdpa, plain, plus = (
            attention_row(result, n, m) for m in ("sdpa", "kernel-i-clustered", "kernel-i-clustered+")
        )
        rows.append(
            [
                tokens(n),
                ms(sdpa["median_ms"]),
                ms(plain["median_ms"]),
                ms(plus["median_ms"]),
                f"**{plus['cost_vs_i_clustered']:.2f}**",
            ]
        )
    header = [
        "N",
        "SDPA ms",
        "i-clustered ms",
        "i-clustered+ ms",
        "i-clustered+ / i-clustered (target ≤ 1.2)",
    ]
    return table_lines(header, "rrrrr", rows) + ["", attention_caption(results)]


def lowest_ratio(results: list[dict], n: int) -> float | None:
    """i-clustered's × SDPA at N in fp32, the lower over the runs."""
    found = [
        attention_row(r, n, "kernel-i-clustered")
        for r in results
        if DTYPE_LABELS[r["shape"]["dtype"]] == "fp32" and not r["shape"]["mixed_lengths"]
    ]
    return min((f["speedup_vs_sdpa"] for f in found if f), default=None)


if __name__ == "__main__":
    main()
