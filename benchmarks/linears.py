"""The floor under a patched model's time: its encoder's linear layers alone, at a document's length.

``convert`` replaces attention and nothing else, so a patched forward still runs every projection and
feed-forward product of the unmodified one. The time of those products alone bounds the speedup any
attention can give: at most (unmodified s/doc) / (linear layers' s/doc), with attention free. This script
times each ``nn.Linear`` under the model's ``encoder`` on an input of N tokens (batch 1), in the model's
order, in fp32 or bf16 (torch's own products, as the unmodified and the patched model run them), and
counts their FLOPs (2 x in x out per token). Given ``benchmarks.long_context``'s results (``--long-context``),
it prints that bound next to the measured speedup and the target: a target above the bound is out of
reach on that CPU whatever attention costs (issue 27, item 2's "count that proves it").

    python -m benchmarks.linears --dtype bf16 --long-context docs/results/long_context_zen3/long_bf16.json
    python -m benchmarks.linears --models minilm-l6-16k --lengths 8192 16384 --dtype fp32 --output FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    environment,
    load_average,
    table_lines,
    times,
    tokens,
)
from benchmarks.long_context import DTYPES, MODELS, build_model


def encoder_linears(model) -> list[Any]:
    """The encoder's linear layers in module order (the pooler, on one token, is left out)."""
    import torch

    return [
        module
        for name, module in model.named_modules()
        if "encoder" in name and isinstance(module, torch.nn.Linear)
    ]


def time_linears(linears: list[Any], length: int, repeats: int) -> list[float]:
    """Seconds for all the layers once on (1, length, in) inputs, per repeat, after one warm-up round."""
    import torch

    generator = torch.Generator().manual_seed(0)
    dtype = linears[0].weight.dtype
    inputs = {
        width: torch.randn(1, length, width, generator=generator).to(dtype)
        for width in {layer.in_features for layer in linears}
    }
    times = []
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            began = time.perf_counter()
            for layer in linears:
                layer(inputs[layer.in_features])
            if round_:
                times.append(time.perf_counter() - began)
    return times


def bounds_from(paths: list[str]) -> dict[tuple[str, int], dict[str, Any]]:
    """(model, length) -> the measured row of ``benchmarks.long_context`` results files."""
    rows = {}
    for path in paths:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        for row in document["rows"]:
            rows[(row["model"], row["length"])] = {**row, "source": path}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["minilm-l6-16k"], choices=sorted(MODELS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--long-context",
        nargs="*",
        default=[],
        metavar="FILE",
        help="benchmarks.long_context results in the same dtype: the bound beside each speedup",
    )
    parser.add_argument(
        "--cache", default=None, help="where the long-context proxy is built (its default cache)"
    )
    parser.add_argument("--output", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if any(length < 1 for length in args.lengths) or args.repeats < 1 or args.threads < 1:
        parser.error("--lengths, --repeats and --threads must be positive")

    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    measured = bounds_from(args.long_context)
    rows = []
    for name in args.models:
        model, _ = build_model(name, args.cache)
        model = model.to(getattr(torch, DTYPES[args.dtype]))
        linears = encoder_linears(model)
        for length in args.lengths:
            times = time_linears(linears, length, args.repeats)
            seconds = statistics.median(times)
            flop = sum(2 * length * layer.in_features * layer.out_features for layer in linears)
            row: dict[str, Any] = {
                "model": name,
                "length": length,
                "dtype": args.dtype,
                "layers": len(linears),
                "gflop": flop / 1e9,
                "linears_s": seconds,
                "gflop_per_s": flop / seconds / 1e9,
                "raw_s": times,
                "load_average": load_average(),
            }
            found = measured.get((name, length))
            if found is not None and found.get("dtype", args.dtype) == args.dtype and found.get("sdpa_s"):
                row["unmodified_s"] = found["sdpa_s"]
                row["bound"] = found["sdpa_s"] / seconds
                row["speedup"] = found.get("speedup")
                row["target_speedup"] = found.get("target_speedup")
                row["target_within_bound"] = (
                    None if row["target_speedup"] is None else row["target_speedup"] <= row["bound"]
                )
                row["source"] = found["source"]
            rows.append(row)

    table = Table(title=f"encoder linear layers alone, batch 1, {args.dtype}, {args.threads} threads")
    for column in (
        "model",
        "tokens",
        "GFLOP",
        "linears s",
        "GFLOP/s",
        "unmodified s",
        "bound",
        "speedup",
        "target",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")

    def cell(value: Any, pattern: str) -> str:
        return "-" if value is None else format(value, pattern)

    for row in rows:
        table.add_row(
            row["model"],
            f"{row['length']:,}",
            f"{row['gflop']:.1f}",
            f"{row['linears_s']:.2f}",
            f"{row['gflop_per_s']:.1f}",
            cell(row.get("unmodified_s"), ".2f"),
            cell(row.get("bound"), ".2f"),
            cell(row.get("speedup"), ".2f"),
            cell(row.get("target_speedup"), ".1f"),
        )
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    if args.output:
        document = {"settings": vars(args), "environment": environment(args.threads), "rows": rows}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return 0


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def bound_table(results: list[dict]) -> list[str]:
    """The encoder's linear layers alone, and the speedup they leave room for."""
    rows = []
    for result in results:
        for row in result["rows"]:
            rows.append(
                [
                    row["dtype"],
                    tokens(row["length"]),
                    f"{row['gflop']:.0f}",
                    f"{row['linears_s']:.2f} ({row['gflop_per_s']:.0f} GFLOP/s)",
                    f"{row['unmodified_s']:.2f}",
                    f"**{times(row['bound'])}**",
                    times(row["speedup"]),
                    f"{row['target_speedup']:.1f}×"
                    + ("" if row["target_within_bound"] else " (out of reach)"),
                ]
            )
    header = [
        "dtype",
        "tokens",
        "linear layers' GFLOP",
        "their s/doc alone",
        "unmodified s/doc",
        "bound: speedup with attention free",
        "patched (measured)",
        "target",
    ]
    first = results[0]
    environment = first["environment"]
    caption = (
        f"{first['rows'][0]['model']}, batch 1, {environment['threads']} threads, median of "
        f"{first['settings']['repeats']} repeats; torch {environment['torch']}; "
        f"{', '.join(sorted({r['environment']['date'][:10] for r in results}))}. Unmodified and patched: "
        f"{', '.join(sorted({row['source'] for r in results for row in r['rows']}))}."
    )
    return table_lines(header, "lrrrrrrr", rows) + ["", caption]


if __name__ == "__main__":
    raise SystemExit(main())
