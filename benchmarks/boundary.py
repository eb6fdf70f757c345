"""The attention function transformers calls against the op it runs (issue 41, item 2).

One (1 x 12 x N x 64) call, i-clustered (C = 25, k = 32 at every length: no growth, ``min_length=0``,
backend cpu), fp32: ``torch.ops.bert_cluster.clustered_heads`` alone against ``hf.attention_forward`` (the
function registered with transformers' ``AttentionInterface``, which hands transformers a (B, L, H, D)
tensor), in interleaved rounds (each round runs both, in alternating order) so that load on a shared
machine hits both alike. Reports each one's median and the ratio of the medians, and writes JSON.

    python -m benchmarks.boundary --length 4096 --rounds 40 --output /tmp/boundary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    ms,
    table_lines,
    time_rounds,
)


def setup(length: int, mode: str, heads: int = 12, dims: int = 64) -> tuple[Any, Any]:
    """(op call, function call): closures over the same inputs and settings."""
    import transformers

    import bert_cluster
    from bert_cluster import attention, ops
    from bert_cluster.hf import attention_forward, attention_modules, settings_of

    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=heads * 4,
        num_hidden_layers=1,
        num_attention_heads=heads,
        intermediate_size=8,
    )
    model = bert_cluster.convert(
        transformers.BertModel(config),
        clusters=25,
        topk=32,
        mode=mode,
        min_length=0,
        cluster_growth=0.0,
        topk_growth=0.0,
        backend="cpu",
    )
    module = attention_modules(model)[0]  # layer 0: convert numbers the layers
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, dims, generator=generator) for _ in range(3))
    valid = torch.ones(1, length, dtype=torch.bool)
    scaling = dims**-0.5
    settings, _ = settings_of(model.config)
    clusters, topk = settings.row_settings(length)
    arguments = attention.step_arguments(settings, clusters, topk, scaling, 0, query)

    def op() -> torch.Tensor:
        return ops.clustered_heads(query, key, value, valid, *arguments)

    def function() -> torch.Tensor:
        return attention_forward(module, query, key, value, valid, scaling=scaling)[0]

    return op, function


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--mode", default="i-clustered", choices=["clustered", "i-clustered", "i-clustered+"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    op, function = setup(args.length, args.mode)
    with torch.inference_mode():
        assert torch.equal(function(), op().transpose(1, 2))
        for _ in range(3):  # warm-up: plans, hash planes, the allocator
            op(), function()
        seconds = time_rounds({"op": op, "function": function}, args.rounds, "alternating")
        times = {name: [1e3 * value for value in values] for name, values in seconds.items()}
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "length": args.length,
        "mode": args.mode,
        "threads": args.threads,
        "rounds": args.rounds,
        "median_ms": medians,
        "function_over_op": medians["function"] / medians["op"],
        "times_ms": times,
        "torch": torch.__version__,
    }
    print(
        f"N = {args.length}, {args.mode}, {args.threads} threads, {args.rounds} interleaved rounds: "
        f"op {medians['op']:.2f} ms, function {medians['function']:.2f} ms, "
        f"function / op {result['function_over_op']:.3f}"
    )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def table(data: list[dict]) -> list[str]:
    """The attention function transformers calls against the op (this benchmark's results)."""
    runs_ = data[0]["runs"]
    rows = [
        [
            str(run["threads"]),
            str(run["pair"]),
            run["kernels"],
            ms(run["median_ms"]["op"]),
            ms(run["median_ms"]["function"]),
            f"{run['function_over_op']:.3f}",
        ]
        for run in sorted(runs_, key=lambda r: (r["threads"], r["pair"]))
    ]
    lines = table_lines(["threads", "pair", "code", "op ms", "function ms", "function / op"], "rrlrrr", rows)
    first = runs_[0]
    lines += [
        "",
        f"1 x 12 x {first['length']:,} x 64, {first['mode']}, C = 25, k = 32, median of {first['rounds']} "
        f"interleaved rounds, torch {first['torch']}. {data[0]['note']}",
    ]
    return lines


if __name__ == "__main__":
    main()
