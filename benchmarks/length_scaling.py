"""Cluster counts for long inputs: time and document-embedding cosine to exact, per length and setting.

The long-context proxy minilm-l6-16k (all-MiniLM-L6-v2 with its positions copied to 16k; build it with
``python ../shared/models/build.py OUT minilm-l6-16k``) embeds documents made from the SQuAD v1.1 dev
articles (each article's paragraphs joined; consecutive articles joined until a document reaches the
length, then truncated there, so every document of a column has exactly that many tokens). For every
document: one forward pass, batch 1, unmodified (SDPA) and once per setting, interleaved, so the ratios
are same-run; the embedding is the model's own pooling (mean over tokens, normalised) and is compared
with the unmodified one by cosine. Prints a table and writes JSON.

    python -m benchmarks.length_scaling --model /tmp/w5-models/minilm-l6-16k --threads 2 \\
        --lengths 2048 4096 8192 16384 --settings "C25 fixed" "C100 fixed" default \
        --output results/length_scaling.json

A setting is a space-separated list: ``C<n>`` clusters, ``k<n>`` top-k, ``L<n>`` iterations,
``cg=<x>`` / ``kg=<x>`` cluster_growth / topk_growth, ``fixed`` (both growths 0), a mode name
(``i-clustered``, ``i-clustered+``, ``clustered``), ``default`` (nothing changed); anything not given is
``convert``'s default, except min_length=0: these lengths are far above any crossover, and a crossover
measured on a busy machine must not decide here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import (
    ROOT,
    environment,
    table_lines,
    times,
    tokens,
)
from bert_cluster.environment import shared_dir

#: ../shared as the tests find it (BERT_CLUSTER_SHARED overrides; a git worktree may sit one level deeper).
SHARED = next(
    (p for p in (shared_dir(ROOT.parent / "shared"), ROOT.parents[1] / "shared") if (p / "data").is_dir()),
    ROOT.parent / "shared",
)
SQUAD = SHARED / "data/squad/dev-v1.1.json"


def parse_setting(text: str) -> dict:
    """``"C100 k64 fixed"`` -> convert keyword arguments."""
    from bert_cluster.config import MODES

    settings: dict = {}
    for token in text.split():
        if token == "fixed":
            settings.update(cluster_growth=0.0, topk_growth=0.0)
        elif token == "default":
            pass
        elif token.startswith(("cg=", "kg=")):
            settings["cluster_growth" if token[0] == "c" else "topk_growth"] = float(token[3:])
        elif token in MODES:
            settings["mode"] = token
        elif token[0] in "CkL" and token[1:].isdigit():
            settings[{"C": "clusters", "k": "topk", "L": "iterations"}[token[0]]] = int(token[1:])
        else:
            raise SystemExit(
                f"bad setting {token!r} in {text!r}: use C<n>, k<n>, L<n>, cg=<x>, kg=<x>, fixed, "
                f"or a mode ({', '.join(MODES)})"
            )
    return settings


def documents(tokenizer, length: int, count: int, squad: Path) -> list[list[int]]:
    """``count`` documents of exactly ``length`` tokens from consecutive SQuAD articles (fewer if too few)."""
    articles = json.loads(squad.read_text())["data"]
    texts = ["\n\n".join(p["context"] for p in article["paragraphs"]) for article in articles]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    docs, current = [], []
    for article in ids:
        current += article
        if len(current) >= length - 2:
            docs.append([tokenizer.cls_token_id, *current[: length - 2], tokenizer.sep_token_id])
            current = []
            if len(docs) == count:
                break
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path("/tmp/w5-models/minilm-l6-16k"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument(
        "--docs", type=int, default=6, help="documents per length (fewer at 16k, see --docs-16k)"
    )
    parser.add_argument("--docs-16k", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=["C25 fixed", "cg=0.5 kg=0.5", "default"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--squad", type=Path, default=SQUAD)
    parser.add_argument("--output", type=Path, default=Path("results/length_scaling.json"))
    args = parser.parse_args()

    import torch
    import transformers

    import bert_cluster

    if not (args.model / "config.json").is_file():
        raise SystemExit(
            f"{args.model} is not a model folder: python ../shared/models/build.py OUT minilm-l6-16k"
        )
    torch.set_num_threads(args.threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(args.model))
    model = transformers.AutoModel.from_pretrained(str(args.model), attn_implementation="sdpa").eval()
    variants = {"sdpa": None, **{text: parse_setting(text) for text in args.settings}}

    def embed(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        seconds = time.perf_counter() - start
        return torch.nn.functional.normalize(hidden.mean(1), dim=-1)[0], seconds

    rows = []
    with torch.inference_mode():
        for length in args.lengths:
            count = args.docs_16k if length > 8192 else args.docs
            docs = documents(tokenizer, length, count, args.squad)
            times: dict[str, list[float]] = {name: [] for name in variants}
            cosines: dict[str, list[float]] = {name: [] for name in variants if name != "sdpa"}
            for number, doc in enumerate(docs):
                ids = torch.tensor([doc])
                exact = None
                for name, settings in variants.items():
                    if settings is None:
                        if hasattr(model.config, "clustered_attention"):
                            bert_cluster.revert(model)
                    else:
                        bert_cluster.convert(model, **{"min_length": 0, **settings})
                    if number == 0:
                        embed(ids[:, :1024])  # warm-up (and the auto crossover, once)
                    vector, seconds = embed(ids)
                    times[name].append(seconds)
                    if settings is None:
                        exact = vector
                    else:
                        cosines[name].append(float(vector @ exact))
                print(f"  {length} tokens: document {number + 1}/{len(docs)}", file=sys.stderr)
            base = statistics.median(times["sdpa"])
            for name in variants:
                median = statistics.median(times[name])
                ratios = [s / t for s, t in zip(times["sdpa"], times[name], strict=True)]
                row = {
                    "tokens": length,
                    "documents": len(docs),
                    "setting": name,
                    "median_s": median,
                    "speedup_vs_sdpa": base / median,
                    "speedup_median_of_ratios": statistics.median(ratios),
                }
                if name != "sdpa":
                    c, k = bert_cluster.ClusteredAttentionConfig(**variants[name]).row_settings(length)
                    row.update(
                        clusters=c,
                        topk=k,
                        cosine_mean=statistics.fmean(cosines[name]),
                        cosine_min=min(cosines[name]),
                    )
                rows.append(row)
    print(
        f"{'tokens':>6}  {'setting':<16} {'C':>4} {'k':>4}  {'median s':>9}  {'x sdpa':>6}  "
        f"{'cos mean':>8}  {'cos min':>8}"
    )
    for r in rows:
        extra = f"{r['clusters']:>4} {r['topk']:>4}  " if "clusters" in r else f"{'':>4} {'':>4}  "
        cos = f"{r['cosine_mean']:>8.4f}  {r['cosine_min']:>8.4f}" if "cosine_mean" in r else ""
        print(
            f"{r['tokens']:>6}  {r['setting']:<16} {extra}{r['median_s']:>9.2f}  "
            f"{r['speedup_median_of_ratios']:>6.2f}  {cos}"
        )
    machine = environment(args.threads)
    result = {
        "date": machine["date"],
        "model": str(args.model),
        "torch": machine["torch"],
        "threads": args.threads,
        "timing": "one forward pass per document and variant, batch 1, interleaved; "
        "x sdpa = median of per-document ratios",
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


# --- tables (benchmarks.render) ----------------------------------------------------------------------

#: The setting names when those runs were made ("default" was 0.1's).
LENGTH_SETTINGS = {
    "default": "i-clustered, growth 0.75 / 0.5 (0.1's default)",
    "i-clustered+": "i-clustered+ at 0.1's C and k",
    "i-clustered+ cg=0.5": "**i-clustered+, growth 0.5 / 0.5 (0.2's default)**",
    "i-clustered+ cg=0.25": "i-clustered+, growth 0.25 / 0.5",
    "i-clustered+ cg=0.5 kg=0.25": "i-clustered+, growth 0.5 / 0.25",
}


def table(results: list[dict]) -> list[str]:
    rows = []
    for result in results:
        for row in result["rows"]:
            if row["setting"] == "sdpa":
                continue
            rows.append(
                [
                    tokens(row["tokens"]),
                    LENGTH_SETTINGS.get(row["setting"], row["setting"]),
                    str(row["clusters"]),
                    str(row["topk"]),
                    f"{row['cosine_mean']:.3f} / {row['cosine_min']:.3f}",
                    times(row["speedup_median_of_ratios"]),
                ]
            )
    caption = f"{results[0]['threads']} thread(s); {results[0]['timing']}; {results[0]['date'][:10]}."
    return table_lines(["N", "setting", "C", "k", "cosine mean / min", "× SDPA"], "llrrlr", rows) + [
        "",
        caption,
    ]


if __name__ == "__main__":
    main()
