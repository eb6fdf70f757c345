"""bert-cluster against its peers on long documents: same machine, same run, same documents (issue 26.2).

Every method embeds the same token ids with the same weights through sentence-transformers (mean
pooling, normalised), batch 1, on the CPU, with the same number of threads:

  torch              the unmodified model, sentence-transformers' torch backend, fp32 (SDPA, exact)
  bert-cluster       the same model after ``bert_cluster.convert`` with its defaults, fp32
  bert-cluster-bf16  the same, the model cast to bfloat16 before ``convert``
  onnx               sentence-transformers ``backend="onnx"`` (ONNX Runtime, CPU provider), exported
                     from the same weights and optimised by ``export_optimized_onnx_model`` at level O2:
                     the highest exact level (O3 adds the GELU approximation, O4 fp16, GPU-only)
  openvino           sentence-transformers ``backend="openvino"`` (optimum-intel), exported from the
                     same weights; ``--openvino-precision f32`` (the default) compiles it with
                     ``INFERENCE_PRECISION_HINT=f32``, the exact fp32 path; ``default`` leaves the hint
                     out, so the CPU plugin runs its own choice (bf16 on CPUs with bf16 instructions).
                     The results file records which (``openvino_precision``)

Models: ``minilm-l6-16k`` (all-MiniLM-L6-v2 with its positions copied to 16,384, built by
``../shared/models/build.py``; SQuAD articles joined and cut to the length), ``modernbert-base``
(ModernBERT-base's size, random weights, seed 0, saved once as a folder every method loads; random
token ids), ``tiny-bert`` (a 2-layer random BERT, for smoke runs and tests).

The peers need a transformers 4.x that transformers 5 / sentence-transformers 6 in ``.venv`` exclude,
so they run in ``.venv-peers`` (``scripts/setup_peers.sh``). Each (model, length, method) is measured
in its own process of the right environment, under a resident-set cap (a watchdog kills it above
``--memory-cap-gib``) and a time limit; an export error, an out-of-memory kill or a timeout is that
cell's result. Per cell: documents/s (median over repeats of documents / wall time of one pass over
them, after a warm-up forward of the first document), the process's own peak resident set (its
VmHWM; for a cell that failed, the highest the watchdog saw), the forward's own peak (VmHWM reset
before one forward, as in ``benchmarks.long_context``), and the cosine of each document's embedding to
the unmodified fp32 torch one.

    bash scripts/setup_peers.sh                    # once: .venv-peers with the pinned peers
    python -m benchmarks.peers                     # everything (over an hour on 2 busy cores)
    python -m benchmarks.peers --quick             # smoke run: tiny-bert, 64 tokens, one document
    python -m benchmarks.peers --models minilm-l6-16k --lengths 512 2048 --methods torch,onnx
    python -m benchmarks.peers --models minilm-l6-16k --lengths 8192 16384 --openvino-precision default
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The harness imports only the standard library at module level, so the peers' environment can use it.
from benchmarks.harness import (
    ROOT,
    environment,
    joined,
    joined_articles,
    load_average,
    memory_status,
    module_command,
    module_env,
    package_versions,
    release_free_memory,
    reset_peak,
    squad_articles,
    table_lines,
    times,
    tokens,
)

#: Lengths (tokens) measured per model, and the model's position limit.
MODELS: dict[str, dict[str, Any]] = {
    "minilm-l6-16k": {"lengths": (512, 2048, 4096, 8192, 16384), "max_length": 16384},
    "modernbert-base": {"lengths": (2048, 8192), "max_length": 8192},
    "tiny-bert": {"lengths": (64,), "max_length": 512},
}
#: Method -> the environment it runs in ("main": this project's .venv, "peers": .venv-peers).
METHODS: dict[str, str] = {
    "torch": "main",
    "bert-cluster": "main",
    "bert-cluster-bf16": "main",
    "onnx": "peers",
    "openvino": "peers",
}
OURS = ("bert-cluster", "bert-cluster-bf16")
PEERS = ("torch", "onnx", "openvino")
REFERENCE = "torch"
#: sentence-transformers' ONNX optimisation level used (see the module docstring for why O2).
ONNX_LEVEL = "O2"
ONNX_FILE = f"onnx/model_{ONNX_LEVEL}.onnx"
#: Issue 26.2's targets on minilm-l6-16k: bert-cluster's documents/s over the fastest peer's, and the cosine.
TARGETS = {8192: 3.0, 16384: 5.0}
COSINE_TARGET = 0.98
DEFAULT_OUTPUT = ROOT / "docs" / "results" / "peers" / "bench_peers.json"
DEFAULT_WORK = ROOT / "results" / "peers"
DEFAULT_PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
#: --openvino-precision -> INFERENCE_PRECISION_HINT (None: the hint is not set, the plugin chooses).
OPENVINO_PRECISIONS: dict[str, str | None] = {"default": None, "f32": "f32"}
#: What every run before the option used (and what a results file without ``openvino_precision`` ran).
DEFAULT_OPENVINO_PRECISION = "f32"
#: ModernBERT-base's size (as ``benchmarks.long_context`` builds it).
MODERNBERT_BASE = {
    "hidden_size": 768,
    "intermediate_size": 1152,
    "num_hidden_layers": 22,
    "num_attention_heads": 12,
    "max_position_embeddings": 8192,
    "local_attention": 128,
    "global_attn_every_n_layers": 3,
}
TINY_BERT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}


# --------------------------------------------------------------------------------------------------
# Worker side (either environment): one method, one model, one length
# --------------------------------------------------------------------------------------------------


def openvino_config(precision: str, threads: int) -> dict[str, str]:
    """The ``ov_config`` OpenVINO compiles the model with: threads, latency, and the precision hint if any."""
    if precision not in OPENVINO_PRECISIONS:
        raise ValueError(f"unknown OpenVINO precision {precision!r}; known: {', '.join(OPENVINO_PRECISIONS)}")
    config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY"}
    hint = OPENVINO_PRECISIONS[precision]
    if hint is not None:
        config["INFERENCE_PRECISION_HINT"] = hint
    return config


def load_method(
    method: str,
    model_dir: Path,
    export_dir: Path,
    threads: int,
    openvino_precision: str = DEFAULT_OPENVINO_PRECISION,
):
    """The SentenceTransformer a method runs (converted, cast or exported as the method says)."""
    import torch
    from sentence_transformers import SentenceTransformer

    if method in ("torch", "bert-cluster", "bert-cluster-bf16"):
        model = SentenceTransformer(
            str(model_dir), device="cpu", model_kwargs={"attn_implementation": "sdpa"}
        )
        if method == "bert-cluster-bf16":
            model = model.to(torch.bfloat16)
        if method != "torch":
            import bert_cluster

            bert_cluster.convert(model)
        return model.eval()
    if method == "onnx":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        kwargs = {"file_name": ONNX_FILE, "provider": "CPUExecutionProvider", "session_options": options}
        return SentenceTransformer(str(export_dir), device="cpu", backend="onnx", model_kwargs=kwargs)
    if method == "openvino":
        ov_config = openvino_config(openvino_precision, threads)
        return SentenceTransformer(
            str(export_dir), device="cpu", backend="openvino", model_kwargs={"ov_config": ov_config}
        )
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def export_method(method: str, model_dir: Path, export_dir: Path) -> dict[str, Any]:
    """Export the model folder for a peer backend, the way sentence-transformers documents it."""
    from sentence_transformers import SentenceTransformer

    began = time.perf_counter()
    if method == "onnx":
        from sentence_transformers import export_optimized_onnx_model

        model = SentenceTransformer(str(model_dir), device="cpu", backend="onnx")
        model.save(str(export_dir))
        export_optimized_onnx_model(model, ONNX_LEVEL, str(export_dir))
        if not (export_dir / ONNX_FILE).exists():
            raise RuntimeError(f"export_optimized_onnx_model wrote no {ONNX_FILE}")
    elif method == "openvino":
        model = SentenceTransformer(str(model_dir), device="cpu", backend="openvino")
        model.save(str(export_dir))
    else:
        raise ValueError(f"{method!r} needs no export")
    return {"export_s": time.perf_counter() - began}


#: The packages a method may use: their versions are recorded from each environment that runs one.
PACKAGES = (
    "torch",
    "transformers",
    "sentence-transformers",
    "onnxruntime",
    "onnx",
    "optimum",
    "optimum-onnx",
    "optimum-intel",
    "openvino",
    "bert-cluster",
)


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """``versions``, ``export`` or ``measure`` (time, memory and embeddings of one method at one length)."""
    if job["mode"] == "versions":
        return package_versions(PACKAGES)
    if job["mode"] == "export":
        return export_method(job["method"], Path(job["model_dir"]), Path(job["export_dir"]))
    import torch

    threads = job["threads"]
    torch.set_num_threads(threads)
    documents = [torch.tensor([ids]) for ids in json.loads(Path(job["inputs"]).read_text())]
    with_token_types = job["token_types"]
    loaded_at = memory_status()["VmRSS"]
    precision = job.get("openvino_precision", DEFAULT_OPENVINO_PRECISION)
    model = load_method(job["method"], Path(job["model_dir"]), Path(job["export_dir"]), threads, precision)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if with_token_types:
            features["token_type_ids"] = torch.zeros_like(ids)
        with torch.inference_mode():
            return model.forward(features)["sentence_embedding"][0].float()

    forward(documents[0])  # warm-up: thread pools, kernels, bert-cluster's first-use crossover, ORT arenas
    loading_peak = memory_status()["VmHWM"]  # this process's own peak so far (reset below)
    release_free_memory()
    was_reset = reset_peak()
    before = memory_status()
    forward(documents[0])
    after = memory_status()
    passes, embeddings = [], []
    for repeat in range(job["repeats"]):
        began = time.perf_counter()
        for ids in documents:
            vector = forward(ids)
            if repeat == 0:
                embeddings.append(vector.tolist())
        passes.append(time.perf_counter() - began)
    return {
        "pass_s": passes,
        "embeddings": embeddings,
        "model_rss_mib": before["VmRSS"] - loaded_at,
        "forward_extra_mib": after["VmHWM"] - before["VmRSS"] if was_reset else None,
        # Not wait4's ru_maxrss: on Linux that also counts the parent's resident set at the spawn (vfork).
        "peak_rss_mib": max(loading_peak, memory_status()["VmHWM"]),
    }


# --------------------------------------------------------------------------------------------------
# Driver side: models, documents, one capped process per cell, summary, table, JSON, plot
# --------------------------------------------------------------------------------------------------


def write_st_folder(model, tokenizer_dir: Path, out: Path) -> None:
    """A sentence-transformers folder (Transformer, mean Pooling, Normalize) that both environments load."""
    import shutil

    from transformers import AutoTokenizer

    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": model.config.max_position_embeddings, "do_lower_case": False})
    )
    pooling = out / "1_Pooling"
    pooling.mkdir(exist_ok=True)
    shutil.copy(tokenizer_dir / "1_Pooling" / "config.json", pooling / "config.json")
    config = json.loads((pooling / "config.json").read_text())
    config["word_embedding_dimension"] = model.config.hidden_size
    (pooling / "config.json").write_text(json.dumps(config, indent=2))


def prepare_model(name: str, work: Path) -> Path:
    """The model's folder under ``work/models`` (built once; random weights seeded)."""
    import torch
    import transformers

    from bert_cluster.checkpoints import default_model_path

    folder = work / "models" / name
    if (folder / "modules.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    if name == "minilm-l6-16k":
        build = ROOT.parent / "shared" / "models" / "build.py"
        if not build.exists():
            raise SystemExit(f"{build} is missing (../shared is needed for the long-context proxy)")
        subprocess.run(
            [sys.executable, str(build), str(folder.parent), name], check=True, capture_output=True
        )
        return folder
    torch.manual_seed(0)
    if name == "modernbert-base":
        config = transformers.ModernBertConfig(**MODERNBERT_BASE)
    elif name == "tiny-bert":
        config = transformers.BertConfig(**TINY_BERT)
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = transformers.AutoModel.from_config(config)
    write_st_folder(model, default_model_path(), folder)
    return folder


def document_ids(name: str, folder: Path, length: int, count: int) -> list[list[int]]:
    """The token ids of ``count`` documents of exactly ``length`` tokens (the same for every method)."""
    if name == "minilm-l6-16k":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        articles = squad_articles()
        out = []
        for document in range(count):
            text = joined_articles(articles, document)
            out.append(tokenizer(text, truncation=True, max_length=length)["input_ids"])
    else:
        import torch

        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        out = [
            torch.randint(
                1000, vocab - 1000, (length,), generator=torch.Generator().manual_seed(1000 + d)
            ).tolist()
            for d in range(count)
        ]
    if any(len(ids) != length for ids in out):
        raise SystemExit(f"documents of {length} tokens asked for, got {[len(ids) for ids in out]}")
    return out


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_capped(python: str, job: dict[str, Any], cap_mib: float, timeout: float) -> dict[str, Any]:
    """Run one job in a fresh process, killed above ``cap_mib`` resident or after ``timeout`` s.

    Returns the worker's result, or ``{"error": ...}``; ``peak_rss_mib`` is the child's own peak
    (its own VmHWM; the watchdog's highest sample where it failed), in both cases.
    """
    import tempfile

    threads = str(job.get("threads", 2))
    env = module_env(
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            [*module_command(__spec__.name, python), "--worker", json.dumps(job)],
            stdout=out,
            stderr=err,
            env=env,
            cwd=ROOT,
        )
        killed: list[str] = []
        highest = [0.0]  # the resident set the watchdog saw (sampled), for cells that fail
        done = threading.Event()

        def watch() -> None:
            began = time.monotonic()
            while not done.wait(0.2):
                rss = rss_mib(process.pid)
                highest[0] = max(highest[0], rss or 0.0)
                if rss is not None and rss > cap_mib:
                    killed.append(f"killed: resident set over the {cap_mib:.0f} MiB cap")
                elif time.monotonic() - began > timeout:
                    killed.append(f"timed out after {timeout:.0f} s")
                if killed:
                    process.kill()
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, status, _ = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        watcher.join()
        peak = highest[0]
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("{")]
        if killed:
            return {"error": killed[0], "peak_rss_mib": peak}
        if process.returncode != 0 or not lines:
            tail = [line for line in err.read().strip().splitlines() if line.strip()]
            reason = tail[-1] if tail else f"exit {process.returncode}"
            if process.returncode < 0:
                reason = f"killed by signal {-process.returncode} ({reason})"
            return {"error": reason[:400], "peak_rss_mib": peak}
        return {"peak_rss_mib": peak, **json.loads(lines[-1])}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def summarise_cell(
    raw: dict[str, Any], documents: int, reference: list[list[float]] | None
) -> dict[str, Any]:
    """documents/s, memory and cosines of one measured cell (``error`` where it failed)."""
    cell: dict[str, Any] = {"peak_rss_mib": raw.get("peak_rss_mib")}
    if "error" in raw:
        cell["error"] = raw["error"]
        return cell
    per_pass = [documents / seconds for seconds in raw["pass_s"]]
    cell.update(
        docs_per_s=statistics.median(per_pass),
        docs_per_s_range=[min(per_pass), max(per_pass)],
        forward_extra_mib=raw.get("forward_extra_mib"),
        model_rss_mib=raw.get("model_rss_mib"),
    )
    if reference is not None:
        cosines = [cosine(a, b) for a, b in zip(raw["embeddings"], reference, strict=True)]
        cell.update(cosine_mean=statistics.fmean(cosines), cosine_min=min(cosines))
    return cell


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Per model, length and our method: the documents/s ratio to each peer and to the fastest peer.

    ``results`` maps model -> length (str) -> method -> cell. Peers that failed at a length are left out of
    "fastest" there (named in ``missing``).
    """
    out: dict[str, Any] = {}
    for model, lengths in results.items():
        for length, cells in lengths.items():
            speeds = {m: c["docs_per_s"] for m, c in cells.items() if c.get("docs_per_s")}
            peers = {m: s for m, s in speeds.items() if m in PEERS}
            for ours in OURS:
                if ours not in speeds:
                    continue
                entry: dict[str, Any] = {m: speeds[ours] / s for m, s in peers.items()}
                if peers:
                    fastest = max(peers, key=peers.get)
                    entry["fastest_peer"] = fastest
                    entry["vs_fastest"] = speeds[ours] / peers[fastest]
                entry["missing"] = sorted(m for m in PEERS if m in cells and m not in peers)
                out.setdefault(model, {}).setdefault(ours, {})[length] = entry
    return out


def crossovers(results: dict[str, Any]) -> dict[str, Any]:
    """Where each of our methods overtakes each peer: the length at which documents/s are equal.

    Interpolated linearly in log(length) between the two measured lengths around the crossing of the
    log ratio; ``None`` with a note when it is ahead (or behind) at every measured length.
    """
    out: dict[str, Any] = {}
    for model, by_ours in ratios(results).items():
        for ours, by_length in by_ours.items():
            lengths = sorted(by_length, key=int)
            for peer in PEERS:
                points = [(int(n), by_length[n][peer]) for n in lengths if peer in by_length[n]]
                if not points:
                    continue
                found: dict[str, Any] = {"length": None, "note": None}
                if points[0][1] >= 1:
                    found["note"] = f"ahead at every measured length (from {points[0][0]})"
                else:
                    for (n0, r0), (n1, r1) in zip(points, points[1:], strict=False):
                        if r0 < 1 <= r1:
                            t = -math.log(r0) / (math.log(r1) - math.log(r0))
                            found["length"] = round(
                                math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))
                            )
                            found["between"] = [n0, n1]
                            break
                    else:
                        found["note"] = f"behind at every measured length (to {points[-1][0]})"
                out.setdefault(model, {}).setdefault(ours, {})[peer] = found
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 26.2's targets on minilm-l6-16k for bert-cluster (fp32), with the measured figures."""
    by_length = ratios(results).get("minilm-l6-16k", {}).get("bert-cluster", {})
    rows = []
    for length, wanted in TARGETS.items():
        entry = by_length.get(str(length))
        cell = results.get("minilm-l6-16k", {}).get(str(length), {}).get("bert-cluster", {})
        row: dict[str, Any] = {"length": length, "speedup_target": wanted, "cosine_target": COSINE_TARGET}
        if entry is None or "vs_fastest" not in entry:
            row["met"] = None
        else:
            row.update(
                fastest_peer=entry["fastest_peer"],
                speedup=entry["vs_fastest"],
                cosine_min=cell.get("cosine_min"),
            )
            row["met"] = bool(
                entry["vs_fastest"] >= wanted and (cell.get("cosine_min") or 0) >= COSINE_TARGET
            )
        rows.append(row)
    return rows


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Documents/s, batch 1 (higher is better); cosine to unmodified fp32 torch")
    for column in (
        "model",
        "tokens",
        "method",
        "docs/s",
        "vs fastest peer",
        "peak RSS MiB",
        "cos mean",
        "cos min",
    ):
        table.add_column(column, justify="left" if column in ("model", "method") else "right")
    all_ratios = ratios(results)
    for model, lengths in results.items():
        for length, cells in lengths.items():
            for method, cell in cells.items():
                entry = all_ratios.get(model, {}).get(method, {}).get(length, {})
                speed = cell.get("docs_per_s")
                table.add_row(
                    model,
                    length,
                    method,
                    f"{speed:.3g}" if speed else f"[red]{cell.get('error', '-')[:60]}[/red]",
                    f"{entry['vs_fastest']:.2f}x ({entry['fastest_peer']})" if "vs_fastest" in entry else "",
                    f"{cell['peak_rss_mib']:.0f}" if cell.get("peak_rss_mib") else "",
                    f"{cell['cosine_mean']:.4f}" if "cosine_mean" in cell else "",
                    f"{cell['cosine_min']:.4f}" if "cosine_min" in cell else "",
                )
    Console(width=150).print(table)


def markdown_table(report: dict[str, Any]) -> str:
    """The README table: documents/s (cosine min) per method and length, one block per model."""
    lines = []
    for model, lengths in report["results"].items():
        methods = [m for m in METHODS if any(m in cells for cells in lengths.values())]
        lines.append(f"**{model}** — documents/s (min cosine to exact fp32)")
        lines.append("")
        precision = report.get("openvino_precision", DEFAULT_OPENVINO_PRECISION)
        names = [f"openvino ({precision})" if m == "openvino" else m for m in methods]
        lines.append("| tokens | " + " | ".join(names) + " |")
        lines.append("|---:|" + "---:|" * len(methods))
        for length, cells in lengths.items():
            shown = []
            for method in methods:
                cell = cells.get(method, {})
                if cell.get("docs_per_s"):
                    cos = (
                        f" ({cell['cosine_min']:.3f})" if "cosine_min" in cell and method != REFERENCE else ""
                    )
                    shown.append(f"{cell['docs_per_s']:.3g}{cos}")
                else:
                    shown.append("failed" if "error" in cell else "-")
            lines.append(f"| {int(length):,} | " + " | ".join(shown) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        for method in METHODS:
            points = [
                (int(n), cells[method]["docs_per_s"])
                for n, cells in results[model].items()
                if cells.get(method, {}).get("docs_per_s")
            ]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                style = "-" if method in OURS else "--"
                axis.plot(xs, ys, style, marker="o", label=method)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tokens per document")
        axis.set_ylabel("documents/s (batch 1)")
        axis.set_title(model)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def machine(threads: int) -> dict[str, Any]:
    """The driver's machine, as the peers tables read it (the harness's environment)."""
    found = environment(threads)
    return {
        "cpu": found["processor"],
        **{key: found[key] for key in ("cpu_count", "platform", "git", "date")},
    }


def write_report(report: dict[str, Any], output: Path) -> None:
    """The JSON (with ratios, crossovers and targets recomputed), its Markdown table and the plot."""
    report["load_average_after"] = load_average()
    report["ratios"] = ratios(report["results"])
    report["crossovers"] = crossovers(report["results"])
    report["targets"] = targets(report["results"])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    output.with_suffix(".md").write_text(markdown_table(report))
    plot(report["results"], output.with_suffix(".png"))


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2 (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=None, help="comma-separated")
    parser.add_argument(
        "--methods", type=lambda s: s.split(","), default=list(METHODS), help="comma-separated"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="only these of each model's")
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="models, exports, inputs")
    parser.add_argument("--peers-python", default=str(DEFAULT_PEERS_PYTHON))
    parser.add_argument("--memory-cap-gib", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny-bert, one document, one repeat")
    parser.add_argument(
        "--openvino-precision",
        choices=list(OPENVINO_PRECISIONS),
        default=DEFAULT_OPENVINO_PRECISION,
        help="f32: INFERENCE_PRECISION_HINT=f32 (exact fp32); default: OpenVINO's own (bf16 where the CPU "
        "has it). Default: %(default)s",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.models = args.models or ["tiny-bert"]
        args.documents, args.repeats = 1, 1
    args.models = args.models or ["minilm-l6-16k", "modernbert-base"]
    problems = [f"unknown model {m!r} (known: {', '.join(MODELS)})" for m in args.models if m not in MODELS]
    problems += [
        f"unknown method {m!r} (known: {', '.join(METHODS)})" for m in args.methods if m not in METHODS
    ]
    for name in ("documents", "repeats", "threads"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.memory_cap_gib <= 0 or args.timeout <= 0:
        problems.append("--memory-cap-gib and --timeout must be positive")
    for length in args.lengths or []:
        if length < 2 or all(length > MODELS[m]["max_length"] for m in args.models if m in MODELS):
            problems.append(f"length {length} is outside 2..the models' position limits")
    if problems:
        parser.error("; ".join(problems))
    return args


def measure_job(
    args: argparse.Namespace, method: str, folder: Path, export_dir: Path, inputs: Path, token_types: bool
) -> dict[str, Any]:
    """The worker's job for one cell: what it loads, with which settings, on which inputs."""
    return {
        "mode": "measure",
        "method": method,
        "model_dir": str(folder),
        "export_dir": str(export_dir),
        "inputs": str(inputs),
        "token_types": token_types,
        "threads": args.threads,
        "repeats": args.repeats,
        "openvino_precision": args.openvino_precision,
    }


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (model, length) cells to measure: each model's lengths, or those of --lengths it can take."""
    cells = []
    for model in args.models:
        spec = MODELS[model]
        lengths = (
            spec["lengths"] if args.lengths is None else [n for n in args.lengths if n <= spec["max_length"]]
        )
        if args.quick and args.lengths is None:
            lengths = lengths[:1]
        cells += [(model, n) for n in lengths]
    return cells


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from rich.console import Console

    console = Console(stderr=True)
    peers_python = args.peers_python if Path(args.peers_python).exists() else None
    methods = [m for m in METHODS if m in args.methods]
    skipped = {m: f"{args.peers_python} missing (bash scripts/setup_peers.sh)" for m in methods}
    skipped = {m: why for m, why in skipped.items() if METHODS[m] == "peers" and peers_python is None}
    methods = [m for m in methods if m not in skipped]
    for method, why in skipped.items():
        console.print(f"[yellow]skipping {method}: {why}[/yellow]")
    python = {"main": sys.executable, "peers": peers_python}
    cap = args.memory_cap_gib * 1024
    command = "python -m benchmarks.peers " + shlex.join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {
        "command": command,
        "machine": machine(args.threads),
        "threads": args.threads,
        "documents": args.documents,
        "repeats": args.repeats,
        "memory_cap_gib": args.memory_cap_gib,
        "onnx_level": ONNX_LEVEL,
        "openvino_precision": args.openvino_precision,
        "load_average_before": load_average(),
        "versions": {
            env: run_capped(python[env], {"mode": "versions"}, cap, 120)
            for env in sorted({METHODS[m] for m in methods})
        },
        "skipped": skipped,
        "exports": {},
        "results": {},
    }
    work = args.work_dir.resolve()
    for model, length in plan(args):
        folder = prepare_model(model, work)
        for method in methods:  # exports once per model and peer
            key = f"{model}/{method}"
            if METHODS[method] == "peers" and key not in report["exports"]:
                export_dir = work / "exports" / key
                if (export_dir / ("openvino" if method == "openvino" else ONNX_FILE)).exists():
                    report["exports"][key] = {"cached": True}
                else:
                    console.print(f"exporting {key}")
                    job = {
                        "mode": "export",
                        "method": method,
                        "model_dir": str(folder),
                        "export_dir": str(export_dir),
                    }
                    report["exports"][key] = run_capped(python["peers"], job, cap, args.timeout)
        inputs = work / "inputs" / f"{model}_{length}_{args.documents}.json"
        inputs.parent.mkdir(parents=True, exist_ok=True)
        inputs.write_text(json.dumps(document_ids(model, folder, length, args.documents)))
        token_types = json.loads((folder / "config.json").read_text())["model_type"] == "bert"
        cells: dict[str, Any] = {}
        reference = None
        for method in methods:  # METHODS' order: the reference (torch) first
            export = report["exports"].get(f"{model}/{method}", {})
            if "error" in export:
                cells[method] = {"error": f"export: {export['error']}"}
                continue
            console.print(f"{model} {length:>6} {method:<18} load {os.getloadavg()[0]:.2f}")
            job = measure_job(args, method, folder, work / "exports" / model / method, inputs, token_types)
            raw = run_capped(python[METHODS[method]], job, cap, args.timeout)
            if method == REFERENCE and "embeddings" in raw:
                reference = raw["embeddings"]
            cells[method] = summarise_cell(raw, args.documents, reference)
            cells[method]["load_average"] = load_average()
        report["results"].setdefault(model, {})[str(length)] = cells
        write_report(report, args.output)  # after every length: a cut-short run keeps what it measured
    print_table(report["results"])
    png = args.output.with_suffix(".png")
    loads = f"{report['load_average_before']} -> {report['load_average_after']}"
    console.print(f"wrote {args.output}, {png} (load average {loads})")


# --- tables (benchmarks.render) ----------------------------------------------------------------------

PEER_METHODS = ("torch", "onnx", "openvino", "bert-cluster", "bert-cluster-bf16")


def openvino_precision(report: dict) -> str:
    """The precision OpenVINO ran at (a file from before ``--openvino-precision``: the fixed hint, f32)."""
    return report.get("openvino_precision", DEFAULT_OPENVINO_PRECISION)


def table(results: list[dict]) -> list[str]:
    """Documents/s per method (failed cells say so), bert-cluster over the fastest peer, cosines, memory."""
    report = results[0]
    precision = openvino_precision(report)
    rows = []
    for model, lengths in report["results"].items():
        for length, cells in lengths.items():
            ratio = report["ratios"].get(model, {}).get("bert-cluster", {}).get(length, {})
            speeds = [
                f"{cells[m]['docs_per_s']:.3g}"
                if cells.get(m, {}).get("docs_per_s")
                else ("failed" if m in cells else "–")
                for m in PEER_METHODS
            ]
            cosines = [
                f"{cells[m]['cosine_min']:.3f}" if "cosine_min" in cells.get(m, {}) else "–"
                for m in PEER_METHODS[3:]
            ]
            peaks = [
                f"{cells[m]['forward_extra_mib']:,.0f}" if cells.get(m, {}).get("docs_per_s") else "–"
                for m in PEER_METHODS
            ]
            fastest = (
                f"{times(ratio['vs_fastest'])} ({ratio['fastest_peer']})" if "vs_fastest" in ratio else "–"
            )
            rows.append([model, tokens(int(length)), *speeds, fastest, joined(cosines), joined(peaks)])
    header = [
        "model",
        "tokens",
        *(f"openvino ({precision})" if m == "openvino" else m for m in PEER_METHODS),
        "bert-cluster vs fastest peer",
        "min cosine (fp32 / bf16)",
        "forward's peak MiB (same order)",
    ]
    versions = report["versions"].get("peers", {})
    loads = report["load_average_before"], report["load_average_after"]
    caption = (
        f"Documents/s, batch 1, {report['threads']} threads, {report['documents']} documents × "
        f"{report['repeats']} repeats (median), one capped process per cell; {report['machine']['cpu']}, "
        "load average (1 min) "
        f"{loads[0][0]:.1f} before, {loads[1][0]:.1f} after; ONNX Runtime {versions.get('onnxruntime', '?')} "
        f"(level {report['onnx_level']}), OpenVINO {versions.get('openvino', '?')} "
        f"({PRECISION_NOTES[precision]}); run of {report['machine']['date'][:10]}."
    )
    return table_lines(header, "lr" + "r" * (len(header) - 2), rows) + [
        "",
        caption + PEERS_CAPTION + peers_verdicts(report),
    ]


def peers_verdicts(report: dict) -> str:
    """Where bert-cluster (fp32) overtakes each peer on the proxy, and issue 26's targets, as measured."""
    found = report.get("crossovers", {}).get("minilm-l6-16k", {}).get("bert-cluster", {})
    parts = [
        f"{peer} at {tokens(c['length'])} tokens" if c.get("length") else f"{peer}: {c['note']}"
        for peer, c in found.items()
    ]
    targets = [
        f"≥ {t['speedup_target']:g}× at {tokens(t['length'])}: "
        + {True: "met", False: "missed", None: "not measured"}[t["met"]]
        for t in report.get("targets", [])
    ]
    text = ""
    if parts:
        text += f" bert-cluster (fp32) overtakes on minilm-l6-16k: {'; '.join(parts)}."
    if targets:
        text += f" Issue 26's targets (the fastest peer, cosine ≥ 0.98): {'; '.join(targets)}."
    return text


PRECISION_NOTES = {
    "f32": "f32: INFERENCE_PRECISION_HINT=f32, the exact path",
    "default": "default: the CPU plugin's own precision, bf16 where the CPU has bf16 instructions",
}


PEERS_CAPTION = (
    " Forward's peak: the resident set one forward adds (VmHWM reset before it); a failed cell's error,"
    " and each process's own peak, are in the results file."
)


def proxy_ratios(report: dict) -> dict[str, dict]:
    """bert-cluster's (fp32) ratios to the peers on the MiniLM-16k proxy, by length (the summary's)."""
    return report["ratios"].get("minilm-l6-16k", {}).get("bert-cluster", {})


if __name__ == "__main__":
    main()
