"""Whole-model speed, unmodified (transformers' SDPA) vs patched by ``bert_cluster.convert``.

Variants: ``sdpa`` (unmodified); ``auto`` (``convert``'s defaults: min_length="auto", so rows too short for
clustering to pay run SDPA); ``i-clustered`` and ``clustered`` (min_length=0: every row longer than C is
approximated, on the kernels); ``ref-i-clustered`` (min_length=0 on the pure-PyTorch reference). The
claim checked: ``auto`` is never slower than ``sdpa`` at any length or batch size.

Inputs: random token ids, ``--batch`` rows of ``--lengths`` tokens, no padding, or ``--padding mixed``
(rows of uniformly drawn lengths between half and all of the length, right-padded: what an evaluation
feeds). ``--dtype bf16`` casts every variant's model to bfloat16 before ``convert`` (torch's own bf16 path
for the unmodified one). Time: median over interleaved repeats of one forward pass (inference mode), after
a warm-up (which also makes ``auto`` measure its crossover once; the figure is printed). Prints a table,
writes JSON.

    python -m benchmarks.model --threads 2 --output results/bench_model.json
    python -m benchmarks.model --model /tmp/w5-models/minilm-l6-16k --lengths 1024 2048 4096 --batches 1
    python -m benchmarks.model --dtype bf16 --lengths 128 256 384 512 --variants sdpa auto
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness import (
    environment,
    ms,
    table_lines,
    time_rounds,
    times,
)

VARIANTS = ("sdpa", "auto", "i-clustered", "clustered", "ref-i-clustered")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_VARIANTS = ("sdpa", "auto", "i-clustered", "clustered")


def load(variant: str, path: Path, clusters: int, topk: int, dtype: str = "fp32"):
    """The model, in ``dtype``, with ``variant``'s attention."""
    import torch
    import transformers

    import bert_cluster

    model = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    model = model.to(getattr(torch, DTYPES[dtype]))
    if variant == "sdpa":
        return model
    if variant == "auto":
        return bert_cluster.convert(model, clusters=clusters, topk=topk)  # convert's defaults
    mode = variant.removeprefix("ref-")
    backend = "reference" if variant.startswith("ref-") else "auto"
    return bert_cluster.convert(model, clusters=clusters, topk=topk, mode=mode, min_length=0, backend=backend)


def batch_inputs(batch: int, length: int, padding: str, vocab: int, generator):
    import torch

    ids = torch.randint(1000, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if padding == "mixed":
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
        lengths[0] = length  # the batch is as long as its longest row
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192, 256, 384, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--padding", choices=["none", "mixed"], default="none")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--clusters", type=int, default=25)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the models' dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, default=Path("results/bench_model.json"))
    args = parser.parse_args()

    import torch

    from bert_cluster import crossover
    from bert_cluster.checkpoints import default_model_path
    from bert_cluster.errors import UserError

    torch.set_num_threads(args.threads)
    try:
        path = args.model or default_model_path()
    except UserError as error:
        parser.error(f"{error}, or pass --model")
    models = {variant: load(variant, path, args.clusters, args.topk, args.dtype) for variant in args.variants}
    config = models[args.variants[0]].config
    positions = getattr(config, "max_position_embeddings", max(args.lengths))
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            for length in args.lengths:
                if length > positions:
                    print(f"  skipped {length} tokens: the model has {positions} positions", file=sys.stderr)
                    continue
                ids, mask = batch_inputs(batch, length, args.padding, config.vocab_size, generator)
                for model in models.values():
                    model(input_ids=ids, attention_mask=mask)  # warm-up (auto: measures its crossover once)
                feed = {"input_ids": ids, "attention_mask": mask}
                calls = {variant: functools.partial(model, **feed) for variant, model in models.items()}
                times = time_rounds(calls, args.repeats)
                base = statistics.median(times["sdpa"]) if "sdpa" in times else float("nan")
                for variant in models:
                    median = statistics.median(times[variant])
                    ratios = [
                        s / t for s, t in zip(times.get("sdpa", times[variant]), times[variant], strict=True)
                    ]
                    rows.append(
                        {
                            "tokens": length,
                            "batch": batch,
                            "padding": args.padding,
                            "variant": variant,
                            "median_ms": median * 1e3,
                            "tokens_per_s": int(mask.sum()) / median,
                            "speedup_vs_sdpa": base / median,
                            "speedup_median_of_ratios": statistics.median(ratios),
                        }
                    )
                print(f"  timed batch {batch}, {length} tokens", file=sys.stderr)
    header = (
        f"{'batch':>5}  {'tokens':>6}  {'variant':<16}  {'median ms':>10}  {'tokens/s':>10}  {'x sdpa':>7}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['batch']:>5}  {r['tokens']:>6}  {r['variant']:<16}  {r['median_ms']:>10.1f}  "
            f"{r['tokens_per_s']:>10.0f}  {r['speedup_median_of_ratios']:>7.2f}"
        )
    measured = crossover.stored()
    if "auto" in models:
        print(f"auto crossovers in {crossover.cache_dir()}: {sorted(set(measured.values()))}")
    machine = environment(args.threads)
    result = {
        "date": machine["date"],
        "model": str(path),
        **{key: machine[key] for key in ("torch", "threads", "kernels_loaded", "kernels_cpu_isa")},
        "torch_cpu_capability": machine["torch_cpu_capability"],
        "settings": {"clusters": args.clusters, "topk": args.topk, "dtype": args.dtype},
        "auto_crossovers": measured,
        "timing": f"median of {args.repeats} interleaved forward passes after one warm-up; "
        "x sdpa = median of same-repeat ratios",
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def table(results: list[dict]) -> list[str]:
    (result,) = results
    variants = [v for v in dict.fromkeys(r["variant"] for r in result["rows"]) if v != "sdpa"]
    names = {
        "auto": "**`auto`** (convert's default)",
        "i-clustered": "i-clustered, `min_length=0`",
        "clustered": "clustered, `min_length=0`",
    }
    rows = []
    for batch in sorted({r["batch"] for r in result["rows"]}):
        for n in sorted({r["tokens"] for r in result["rows"]}):
            found = {r["variant"]: r for r in result["rows"] if r["batch"] == batch and r["tokens"] == n}
            rows.append(
                [f"{batch} × {n}", ms(found["sdpa"]["median_ms"])]
                + [times(found[v]["speedup_vs_sdpa"]) for v in variants]
            )
    header = ["batch × tokens", "SDPA ms"] + [f"{names.get(v, v)} × SDPA" for v in variants]
    crossovers = sorted(set(result.get("auto_crossovers", {}).values()))
    dtype = result.get("settings", {}).get("dtype")
    model = "all-MiniLM-L6-v2" if dtype is None else f"all-MiniLM-L6-v2 in {dtype}"
    timing = result["timing"].split(";")[0]
    caption = (
        f"{model}, {result['threads']} threads, kernels {result.get('kernels_cpu_isa', '?')}, torch "
        f"{result.get('torch_cpu_capability', '?')}; {timing}; × SDPA: the ratio of the medians; `auto` "
        f"measured its crossover at {', '.join(map(str, crossovers))} tokens; {result['date'][:10]}."
    )
    return table_lines(header, "l" + "r" * (len(header) - 1), rows) + ["", caption]


if __name__ == "__main__":
    main()
