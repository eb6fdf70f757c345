"""``bert-cluster serve`` under load, clustered and --exact, against Infinity on the same model and machine.

Three servers run side by side on loopback, one at a time under load (the others idle): this server with
clustered attention (``convert``'s preset), this server ``--exact`` (the unmodified model, the control),
and Infinity (``infinity_emb v2 --engine torch --device cpu``, from its own environment: ``bash
scripts/setup_peers.sh infinity``), each with the same torch threads. An async HTTP client (httpx) keeps
``concurrency`` requests in flight, one input per request, until a request count or a time runs out
(then it waits for those in flight). Workloads:

- ``short``: queries of 10 to 60 tokens (a SQuAD question, continued by its paragraph to the drawn length);
- ``long-2048`` and ``long-8192``: documents of that many tokens (SQuAD articles, consecutive paragraphs);
- ``mix``: 90% short queries, 10% documents of 8,192 tokens.

Each cell (workload x concurrency) runs in ``--rounds`` rounds, the arms in a rotated order in the first
and the reverse in the second, so that a change of the machine's load falls on every arm alike; a cell's
figures pool its rounds, and each round's throughput is kept. Per arm and cell: requests/s and tokens/s,
latency p50/p95/p99 (and, in the mix, of its short and long requests apart), and every status counted.

``--arms`` picks the servers (default: the three above); ``clustered-no-interleave`` and
``exact-no-interleave`` are this server with ``--no-interleave``, the controls of interleaving (queries run
between a long batch's layers): with them, ``--workloads short long-8192 mix`` measures what interleaving
does to the mix in one run (``interleave_table``).

Targets (issue 68): long documents at 8,192 tokens >= 3x Infinity's throughput; short queries >= 0.9x
Infinity's; in the mix, the short requests' p99 at most one long batch's time (the arm's p50 latency of a
single 8,192-token document) plus twice their short-only p99 at the same concurrency; no error but
deliberate 429s. Each is marked met or missed for every arm, the control's included.

Usage::

    python /work/shared/models/build.py OUT minilm-l6-16k   # the long-context proxy
    bash scripts/setup_peers.sh infinity                      # .venv-infinity
    python -m benchmarks.serve --model OUT/minilm-l6-16k --smoke --output /tmp/serve-smoke.json
    nice -n -5 python -m benchmarks.serve --model OUT/minilm-l6-16k --output docs/results/serve/FILE.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (
    environment,
    joined,
    load_average,
    module_command,
    module_env,
    ms,
    package_versions,
    squad_dev,
    table_lines,
    time_rounds,
    times,
)

ARMS = ("clustered", "exact", "infinity")
#: Every arm ``--arms`` takes: the three above and the controls of interleaving.
ALL_ARMS = (*ARMS, "clustered-no-interleave", "exact-no-interleave")
#: Workload -> concurrency levels, and per arm and cell the most requests and seconds (all rounds).
PLAN: dict[str, dict[int, tuple[int, float]]] = {
    "short": {1: (400, 20.0), 8: (2000, 20.0), 32: (4000, 20.0)},
    "long-2048": {1: (30, 30.0), 4: (60, 30.0)},
    "long-8192": {1: (12, 60.0), 4: (16, 60.0)},
    "mix": {8: (1000, 60.0), 32: (2000, 60.0)},
}
SMOKE: dict[str, dict[int, tuple[int, float]]] = {
    "short": {1: (20, 4.0), 8: (80, 4.0)},
    "long-2048": {1: (2, 10.0)},
    "long-8192": {1: (1, 20.0)},
    "mix": {8: (40, 15.0)},
}
SHORT_TOKENS = (10, 60)
MIX_LONG = 8192
MIX_LONG_SHARE = 0.1
TARGET_LONG = 3.0
TARGET_SHORT = 0.9
#: Ours: inputs up to 8,192 tokens, and a batch of at most 8,192 padded tokens, so that a batch holds one
#: 8,192-token document (a short query waits behind one document, not two).
SERVE_ARGS = ("--max-input-tokens", "8192", "--max-batch-tokens", "8192")
START_S = 900
REQUEST_TIMEOUT_S = 900


# ---------------------------------------------------------------------------------------------------------
# Texts


@dataclasses.dataclass(frozen=True)
class Text:
    """One request's input and its length in tokens (with the special ones)."""

    kind: str
    text: str
    tokens: int


class Texts:
    """Deterministic inputs of given lengths from the SQuAD v1.1 dev file bert-cluster ships."""

    def __init__(self, model: str, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        data = squad_dev()
        self.paragraphs = {paragraph["id"]: paragraph["context"] for paragraph in data["paragraphs"]}
        self.order = list(self.paragraphs)
        self.questions = data["questions"]
        self.random = random.Random(seed)

    def count(self, text: str) -> int:
        """Tokens of ``text`` with the special ones."""
        return len(self.tokenizer(text, truncation=False, verbose=False)["input_ids"])

    def cut(self, text: str, tokens: int) -> str:
        """The longest prefix of ``text`` (whole tokens) of at most ``tokens`` tokens, the special ones in."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = encoded["offset_mapping"]
        keep = min(len(offsets), tokens - 2)
        prefix = text[: offsets[keep - 1][1]] if keep > 0 else ""
        while keep > 1 and self.count(prefix) > tokens:
            keep -= 1
            prefix = text[: offsets[keep - 1][1]]
        return prefix

    def short(self) -> Text:
        """A query of 10 to 60 tokens."""
        question = self.random.choice(self.questions)
        wanted = self.random.randint(*SHORT_TOKENS)
        text = self.cut(f"{question['question']} {self.paragraphs[question['paragraph']]}", wanted)
        return Text("short", text, self.count(text))

    def long(self, tokens: int) -> Text:
        """A document of ``tokens`` tokens (consecutive paragraphs)."""
        start = self.random.randrange(len(self.order))
        parts, words = [], 0
        for index in range(start, start + len(self.order)):
            paragraph = self.paragraphs[self.order[index % len(self.order)]]
            parts.append(paragraph)
            words += len(paragraph.split())
            if words > tokens:  # more than enough: a token is at most a word here
                break
        text = self.cut(" ".join(parts), tokens)
        return Text(f"long-{tokens}", text, self.count(text))

    def workload(self, name: str, count: int) -> list[Text]:
        """``count`` inputs of the workload ``name``."""
        if name == "short":
            return [self.short() for _ in range(count)]
        if name.startswith("long-"):
            return [self.long(int(name.removeprefix("long-"))) for _ in range(count)]
        if name == "mix":  # every tenth a document, the others queries, in a shuffled order
            texts = [
                self.long(MIX_LONG) if index % round(1 / MIX_LONG_SHARE) == 0 else self.short()
                for index in range(count)
            ]
            self.random.shuffle(texts)
            return texts
        raise ValueError(f"unknown workload {name!r}")


# ---------------------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    """A port no one listens on now (loopback)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclasses.dataclass
class Arm:
    """A server under test: how it was started, where it listens, how a request is written."""

    name: str
    command: list[str]
    environment: dict[str, str]
    port: int
    process: subprocess.Popen | None = None
    log: Path | None = None
    model_name: str = ""
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def url(self) -> str:
        """Where it listens."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def path(self) -> str:
        """Its embeddings route."""
        return "/embeddings" if self.name == "infinity" else "/v1/embeddings"

    @property
    def ready_path(self) -> str:
        """The route that answers 200 once it is ready."""
        return "/health" if self.name == "infinity" else "/ready"

    def body(self, text: str) -> dict[str, Any]:
        """One request's JSON: one input."""
        return {"input": [text], "model": self.model_name}


def make_arms(model: str, threads: int, infinity: str, names: tuple[str, ...] = ARMS) -> list[Arm]:
    """The servers ``names`` (of ``ALL_ARMS``): their commands, each on a free port, same threads."""
    threads_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    ours = [*module_command("bert_cluster"), "serve", model, "--threads", str(threads), *SERVE_ARGS]
    quiet = ["--log-level", "warning"]
    arms = [
        Arm("clustered", [*ours, *quiet], threads_env, free_port()),
        Arm("exact", [*ours, "--exact", *quiet], threads_env, free_port()),
        Arm("clustered-no-interleave", [*ours, "--no-interleave", *quiet], threads_env, free_port()),
        Arm("exact-no-interleave", [*ours, "--exact", "--no-interleave", *quiet], threads_env, free_port()),
    ]
    infinity_env = {
        **threads_env,
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        infinity,
        "v2",
        "--model-id",
        model,
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
    ]
    arms.append(Arm("infinity", [*command, "--log-level", "warning"], infinity_env, free_port()))
    arms = [arm for name in names for arm in arms if arm.name == name]
    for arm in arms:
        arm.command += ["--port", str(arm.port)]
    return arms


def start(arm: Arm, folder: Path) -> None:
    """Start ``arm`` and wait until it says it is ready (its warm-up done)."""
    arm.log = folder / f"{arm.name}.log"
    with open(arm.log, "wb") as out:
        arm.process = subprocess.Popen(
            arm.command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **arm.environment}
        )
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if arm.process.poll() is not None:
            raise RuntimeError(f"{arm.name} exited {arm.process.returncode}: {arm.log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(arm.url + arm.ready_path, timeout=5).status_code == 200:
                break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"{arm.name} was not ready within {START_S} s")
    if arm.name == "infinity":
        models = httpx.get(f"{arm.url}/models", timeout=30).json()["data"][0]
        arm.model_name = models["id"]
        arm.facts = {"batch_size": models.get("stats", {}).get("batch_size"), "model_id": models["id"]}
    else:
        info = httpx.get(f"{arm.url}/info", timeout=30).json()
        arm.model_name = info["model"]
        keys = ("exact", "attention", "dtype", "threads", "limits", "warmup", "versions")
        arm.facts = {key: info[key] for key in keys}


def stop(arm: Arm) -> int | None:
    """SIGTERM, then its exit status (killed after two minutes)."""
    if arm.process is None or arm.process.poll() is not None:
        return None if arm.process is None else arm.process.returncode
    arm.process.send_signal(signal.SIGTERM)
    try:
        return arm.process.wait(120)
    except subprocess.TimeoutExpired:
        arm.process.kill()
        return arm.process.wait(30)


# ---------------------------------------------------------------------------------------------------------
# Load


@dataclasses.dataclass
class Sample:
    """One request: its input's kind and tokens, the answer's status, the time it took."""

    kind: str
    tokens: int
    status: int
    seconds: float


async def load(arm: Arm, texts: list[Text], concurrency: int, seconds: float) -> tuple[list[Sample], float]:
    """Keep ``concurrency`` requests in flight over ``texts`` until they or ``seconds`` run out."""
    samples: list[Sample] = []
    position = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=arm.url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        began = time.perf_counter()
        deadline = began + seconds

        async def worker() -> None:
            nonlocal position
            while position < len(texts) and time.perf_counter() < deadline:
                text = texts[position]
                position += 1
                sent = time.perf_counter()
                try:
                    status = (await client.post(arm.path, json=arm.body(text.text))).status_code
                except httpx.HTTPError:
                    status = 0  # no answer: a connection error or a timeout
                samples.append(Sample(text.kind, text.tokens, status, time.perf_counter() - sent))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return samples, wall


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p95/p99 in milliseconds (nearest rank) and the count."""
    if not values:
        return None
    ordered = sorted(values)

    def at(share: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))] * 1000

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "n": len(ordered)}


def summarise(rounds: list[tuple[list[Sample], float]]) -> dict[str, Any]:
    """A cell's figures, its rounds pooled (throughput over their summed wall time)."""
    samples = [sample for round_samples, _ in rounds for sample in round_samples]
    wall = sum(seconds for _, seconds in rounds)
    done = [sample for sample in samples if sample.status == 200]
    statuses: dict[str, int] = {}
    for sample in samples:
        statuses[str(sample.status)] = statuses.get(str(sample.status), 0) + 1
    kinds = sorted({sample.kind for sample in done})
    return {
        "requests": len(done),
        "seconds": wall,
        "requests_per_s": len(done) / wall if wall else None,
        "tokens_per_s": sum(sample.tokens for sample in done) / wall if wall else None,
        "rounds_requests_per_s": [
            sum(s.status == 200 for s in round_samples) / seconds
            for round_samples, seconds in rounds
            if seconds
        ],
        "latency_ms": percentiles([sample.seconds for sample in done]),
        "latency_ms_by_kind": {
            kind: percentiles([sample.seconds for sample in done if sample.kind == kind]) for kind in kinds
        },
        "statuses": statuses,
        "errors": sum(count for status, count in statuses.items() if status not in ("200", "429")),
        "deliberate_429": statuses.get("429", 0),
    }


def measure_cell(
    order: list[Arm], inputs: list[Text], concurrency: int, seconds: float, rounds: int, report: Callable
) -> dict[str, list[tuple[list[Sample], float]]]:
    """Each arm's rounds of one cell, in the harness's alternating order: ``order``, then reversed."""
    results: dict[str, list[tuple[list[Sample], float]]] = {arm.name: [] for arm in order}

    def one_round(arm: Arm) -> None:
        index = len(results[arm.name])  # round ``index`` loads its own share of the inputs
        report(f"{inputs[0].kind} c={concurrency} round {index + 1}/{rounds}: {arm.name}")
        results[arm.name].append(asyncio.run(load(arm, inputs[index::rounds], concurrency, seconds / rounds)))

    time_rounds({arm.name: functools.partial(one_round, arm) for arm in order}, rounds, "alternating")
    return results


def run_plan(
    arms: list[Arm], texts: Texts, plan: dict, rounds: int, report: Callable[[str], None]
) -> list[dict]:
    """Every cell of ``plan``, the arms interleaved (see the module docstring); the cells' figures."""
    cells = []
    for number, (workload, levels) in enumerate(plan.items()):
        for position, (concurrency, (requests, seconds)) in enumerate(levels.items()):
            inputs = texts.workload(workload, requests)
            if position == 0:  # one request of the workload per arm first, not counted
                for arm in arms:
                    asyncio.run(load(arm, texts.workload(workload, 1), 1, REQUEST_TIMEOUT_S))
            rotation = (number + concurrency) % len(arms)
            order = arms[rotation:] + arms[:rotation]
            results = measure_cell(order, inputs, concurrency, seconds, rounds, report)
            for arm in arms:
                cell = {"workload": workload, "concurrency": concurrency, "arm": arm.name}
                cell.update(summarise(results[arm.name]))
                if arm.process is not None and arm.process.poll() is not None:  # it died (e.g. out of memory)
                    cell["server_exited"] = arm.process.returncode
                cells.append(cell)
                rate, p50 = cell["requests_per_s"] or 0, (cell["latency_ms"] or {}).get("p50") or 0
                report(f"  {arm.name:9s} {rate:8.2f} req/s p50 {p50:8.1f} ms statuses {cell['statuses']}")
    return cells


# ---------------------------------------------------------------------------------------------------------
# Targets


def cell_of(cells: list[dict], workload: str, concurrency: int, arm: str) -> dict | None:
    """The cell of that workload, concurrency and arm."""
    return next(
        (c for c in cells if (c["workload"], c["concurrency"], c["arm"]) == (workload, concurrency, arm)),
        None,
    )


def throughput_target(cells: list[dict], workload: str, target: float) -> dict:
    """Each arm's requests/s over Infinity's, per concurrency; met where every level reaches ``target``."""
    levels = sorted({c["concurrency"] for c in cells if c["workload"] == workload})
    arms: dict[str, Any] = {}
    for arm in ("clustered", "exact"):
        ratios = {}
        for level in levels:
            ours, peer = cell_of(cells, workload, level, arm), cell_of(cells, workload, level, "infinity")
            if ours and peer and ours["requests_per_s"] and peer["requests_per_s"]:
                ratios[str(level)] = ours["requests_per_s"] / peer["requests_per_s"]
        arms[arm] = {"ratios": ratios, "met": bool(ratios) and all(r >= target for r in ratios.values())}
    return {"target": target, "over": "infinity", "arms": arms}


def mix_target(cells: list[dict]) -> dict:
    """Per arm and mix concurrency: the short requests' p99 against one long batch + 2x short-only p99."""
    result: dict[str, Any] = {}
    for arm in arms_in(cells):
        single = cell_of(cells, f"long-{MIX_LONG}", 1, arm)
        long_batch = (single or {}).get("latency_ms") or {}
        levels = {}
        for level in sorted({c["concurrency"] for c in cells if c["workload"] == "mix"}):
            mixed = cell_of(cells, "mix", level, arm)
            alone = cell_of(cells, "short", level, arm)
            short_in_mix = ((mixed or {}).get("latency_ms_by_kind") or {}).get("short")
            short_alone = (alone or {}).get("latency_ms")
            if not (short_in_mix and short_alone and long_batch.get("p50")):
                levels[str(level)] = {"met": None, "note": "not measured (a cell is missing)"}
                continue
            bound = long_batch["p50"] + 2 * short_alone["p99"]
            levels[str(level)] = {
                "short_p99_ms": short_in_mix["p99"],
                "bound_ms": bound,
                "long_batch_ms": long_batch["p50"],
                "short_only_p99_ms": short_alone["p99"],
                "met": short_in_mix["p99"] <= bound,
            }
        measured = [entry["met"] for entry in levels.values() if entry["met"] is not None]
        result[arm] = {"levels": levels, "met": bool(measured) and all(measured)}
    return result


def arms_in(cells: list[dict]) -> list[str]:
    """The arms ``cells`` hold, in ``ALL_ARMS``'s order."""
    found = {cell["arm"] for cell in cells}
    return [arm for arm in ALL_ARMS if arm in found]


def targets(cells: list[dict]) -> dict:
    """Issue 68's targets, met or missed per arm."""
    return {
        "long_8192_vs_infinity": throughput_target(cells, "long-8192", TARGET_LONG),
        "short_vs_infinity": throughput_target(cells, "short", TARGET_SHORT),
        "mix_short_p99": mix_target(cells),
        "no_errors": {
            arm: {
                "errors": sum(c["errors"] for c in cells if c["arm"] == arm),
                "deliberate_429": sum(c["deliberate_429"] for c in cells if c["arm"] == arm),
                "met": sum(c["errors"] for c in cells if c["arm"] == arm) == 0,
            }
            for arm in arms_in(cells)
        },
    }


# ---------------------------------------------------------------------------------------------------------
# Run


#: Infinity's packages whose versions its environment records.
INFINITY_PACKAGES = ("infinity-emb", "torch", "sentence-transformers", "transformers")


def infinity_versions(executable: str) -> dict[str, str]:
    """The harness's ``package_versions`` run in Infinity's environment (the python beside ``executable``)."""
    python = str(Path(executable).with_name("python"))
    code = (
        "import json, sys; from benchmarks import harness; "
        "print(json.dumps(harness.package_versions(sys.argv[1:])))"
    )
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        found = subprocess.run(
            [python, "-c", code, *INFINITY_PACKAGES],
            capture_output=True, text=True, timeout=120, env=module_env(), check=True,
        )  # fmt: skip
        return json.loads(found.stdout)
    return {}


def machine(threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the harness's environment, the facts the table reads from it: CPU with its ISA, cores, niceness)."""
    found = environment(threads)
    cpu = f"{found['processor']} (kernels {found['kernels_cpu_isa']}, torch {found['torch_cpu_capability']})"
    return found, {"cpu": cpu, "cores": found["cpu_count"], "nice": os.nice(0)}


@contextlib.contextmanager
def running(arms: list[Arm], folder: Path, report: Callable[[str], None]) -> Iterator[None]:
    """The arms started one after the other (no warm-up overlaps another), stopped at the end."""
    try:
        for arm in arms:  # one at a time: no warm-up overlaps another
            report(f"starting {arm.name}: {' '.join(arm.command)}")
            began = time.perf_counter()
            start(arm, folder)
            arm.facts["start_s"] = round(time.perf_counter() - began, 1)
        yield
    finally:
        for arm in arms:
            arm.facts["exit"] = stop(arm)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model folder every arm serves (minilm-l6-16k)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    parser.add_argument("--infinity", default=".venv-infinity/bin/infinity_emb", help="Infinity's command")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per cell (arms reversed in turn)")
    parser.add_argument("--smoke", action="store_true", help="a short run of every workload (minutes)")
    parser.add_argument("--arms", nargs="+", choices=ALL_ARMS, default=list(ARMS), help="the servers")
    parser.add_argument(
        "--workloads", nargs="+", choices=tuple(PLAN), default=list(PLAN), help="the workloads run"
    )
    parser.add_argument("--output", type=Path, required=True, help="the results JSON file")
    parser.add_argument(
        "--logs", type=Path, default=None, help="folder for the servers' logs (default: beside)"
    )
    args = parser.parse_args(argv)
    if "infinity" in args.arms and not Path(args.infinity).exists():
        parser.error(f"{args.infinity} is missing: bash scripts/setup_peers.sh infinity")
    model = str(Path(args.model).resolve())
    every = SMOKE if args.smoke else PLAN
    plan = {name: levels for name, levels in every.items() if name in args.workloads}
    rounds = 1 if args.smoke else args.rounds
    logs = args.logs or args.output.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    load_before = load_average()
    began = time.time()
    found, facts = machine(args.threads)
    texts = Texts(model)
    arms = make_arms(model, args.threads, args.infinity, tuple(args.arms))
    with running(arms, logs, report):
        cells = run_plan(arms, texts, plan, rounds, report)
    load_after = load_average()
    infinity = infinity_versions(args.infinity) if "infinity" in args.arms else {}
    result = {
        "benchmark": "serve",
        "command": "python -m benchmarks.serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": found["date"],
        "seconds": round(time.time() - began, 1),
        "machine": facts,
        "environment": found,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "model": model,
        "threads": args.threads,
        "rounds": rounds,
        "smoke": args.smoke,
        "plan": {
            w: {str(c): {"requests": n, "seconds": s} for c, (n, s) in levels.items()}
            for w, levels in plan.items()
        },
        "versions": {
            "bert-cluster": found["bert_cluster"],
            "torch": found["torch"],
            "infinity-emb": infinity.get("infinity-emb"),
            "httpx": package_versions(["httpx"]).get("httpx"),
            "infinity": infinity,
        },
        "arms": {
            arm.name: {"command": arm.command, "environment": arm.environment, **arm.facts} for arm in arms
        },
        "cells": cells,
        "targets": targets(cells),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    report(f"wrote {args.output}")
    return 0


# --- tables (benchmarks.render) ----------------------------------------------------------------------

WORKLOADS = {
    "short": "short queries, 10-60 tokens",
    "long-2048": "documents, 2,048 tokens",
    "long-8192": "documents, 8,192 tokens",
    "mix": "mix: 90% short, 10% of 8,192 tokens (short requests' p99)",
}


def table(data: list[dict]) -> list[str]:
    """Requests/s and p99 per workload, concurrency and server; issue 68's targets, met or missed."""
    report = data[0]
    cells = {(c["workload"], c["concurrency"], c["arm"]): c for c in report["cells"]}

    def p99(cell: dict, workload: str) -> float | None:
        latency = (cell.get("latency_ms_by_kind") or {}).get("short") if workload == "mix" else None
        return (latency or cell.get("latency_ms") or {}).get("p99")

    rows = []
    for workload, label in WORKLOADS.items():
        levels = sorted({level for (name, level, _) in cells if name == workload})
        if not levels:
            continue
        found = [[cells.get((workload, level, arm), {}) for level in levels] for arm in ARMS]
        rates = [
            joined([f"{c['requests_per_s']:.3g}" if c.get("requests_per_s") else "–" for c in arm])
            for arm in found
        ]
        ratios = joined(
            [
                times(c["requests_per_s"] / i["requests_per_s"])
                if c.get("requests_per_s") and i.get("requests_per_s")
                else "–"
                for c, i in zip(found[0], found[2], strict=True)
            ]
        )
        latencies = [
            joined([ms(p99(c, workload)) if p99(c, workload) else "–" for c in arm]) for arm in found
        ]
        rows.append([label, joined([str(level) for level in levels]), *rates, ratios, *latencies])
    header = [
        "workload",
        "concurrency",
        "req/s clustered",
        "req/s exact",
        "req/s Infinity",
        "clustered × Infinity",
        "p99 ms clustered",
        "p99 ms exact",
        "p99 ms Infinity",
    ]
    loads = report["load_average_before"], report["load_average_after"]
    caption = (
        f"The MiniLM-16k proxy, {report['threads']} torch thread(s) per server, one input per request, "
        f"{report['rounds']} round(s) per cell (arms in turn, then reversed); {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, shared: load average (1 min) {loads[0][0]:.1f} before, "
        f"{loads[1][0]:.1f} after, the run at nice {report['machine']['nice']}; bert-cluster "
        f"{report['versions']['bert-cluster']}, Infinity {report['versions']['infinity-emb']}; run of "
        f"{report['date'][:10]}. " + verdicts(report["targets"])
    )
    return table_lines(header, "ll" + "r" * (len(header) - 2), rows) + ["", caption]


def verdicts(found: dict) -> str:
    """Issue 68's targets as measured, for every arm (the control's included)."""

    def mark(met: bool | None) -> str:
        return {True: "met", False: "missed", None: "not measured"}[met]

    def ratios(target: dict, arm: str) -> str:
        mine = target["arms"][arm]
        values = ", ".join(f"{r:.3g}× at {c}" for c, r in mine["ratios"].items())
        return f"{arm} {mark(mine['met'])} ({values})"

    long, short = found["long_8192_vs_infinity"], found["short_vs_infinity"]
    parts = [
        f"Targets: 8,192-token documents ≥ {long['target']:g}× Infinity's requests/s: "
        + "; ".join(ratios(long, arm) for arm in ("clustered", "exact")),
        f"short queries ≥ {short['target']:g}×: "
        + "; ".join(ratios(short, arm) for arm in ("clustered", "exact")),
    ]
    mixed = []
    for arm, levels in found["mix_short_p99"].items():
        each = ", ".join(
            f"{ms(entry['short_p99_ms'])} {'≤' if entry['met'] else '>'} {ms(entry['bound_ms'])} ms "
            f"at {level}"
            if entry.get("met") is not None
            else f"{entry.get('note', 'not measured')} at {level}"
            for level, entry in levels["levels"].items()
        )
        mixed.append(f"{arm} {mark(levels['met'])} ({each})")
    parts.append(
        "in the mix, short p99 ≤ one long batch (the arm's p50 for one 8,192-token document) "
        "+ 2 × short-only p99: " + "; ".join(mixed)
    )
    errors = found["no_errors"]
    parts.append(
        "no error but deliberate 429s: "
        + "; ".join(
            f"{arm} {mark(e['met'])} ({e['errors']} errors, {e['deliberate_429']} 429s)"
            for arm, e in errors.items()
        )
    )
    return "; ".join(parts) + "."


def interleave_table(data: list[dict]) -> list[str]:
    """The mix with and without interleaving, per arm: queries' and documents' rates and latencies."""
    report = data[0]
    found = report["targets"]["mix_short_p99"]
    rows = []
    for arm in arms_in(report["cells"]):
        for level, entry in found.get(arm, {}).get("levels", {}).items():
            cell = cell_of(report["cells"], "mix", int(level), arm) or {}
            kinds = cell.get("latency_ms_by_kind") or {}
            short, long = kinds.get("short") or {}, kinds.get(f"long-{MIX_LONG}") or {}
            wall = cell.get("seconds") or 0

            def rate(kind: dict, wall: float = wall) -> str:
                return f"{kind['n'] / wall:.3g}" if wall and kind.get("n") else "–"

            def latency(kind: dict, key: str) -> str:
                return ms(kind[key]) if kind.get(key) else "–"

            rows.append(
                [
                    arm,
                    level,
                    rate(short),
                    rate(long),
                    latency(short, "p50"),
                    latency(short, "p99"),
                    ms(entry["bound_ms"]) if entry.get("bound_ms") else "–",
                    {True: "met", False: "missed", None: "not measured"}[entry.get("met")],
                    latency(long, "p50"),
                ]
            )
    header = [
        "server",
        "concurrency",
        "queries/s",
        "documents/s",
        "query p50 ms",
        "query p99 ms",
        "bound on query p99 ms",
        "bound",
        "document p50 ms",
    ]
    loads = report["load_average_before"], report["load_average_after"]
    caption = (
        f"The mix (90% queries of 10-60 tokens, 10% documents of {MIX_LONG:,} tokens), one input per "
        f"request, {report['threads']} torch thread(s) per server, {report['rounds']} round(s) per cell "
        f"(arms in turn, then reversed); the bound: one long batch (the arm's p50 for one {MIX_LONG:,}-token "
        f"document alone) + 2 × the arm's short-only p99 at the same concurrency; "
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores: load average (1 min) "
        f"{loads[0][0]:.1f} before, {loads[1][0]:.1f} after; run of {report['date'][:10]}."
    )
    return table_lines(header, "ll" + "r" * (len(header) - 2), rows) + ["", caption]


if __name__ == "__main__":
    sys.exit(main())
