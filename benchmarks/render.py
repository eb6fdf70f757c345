"""Render every table of the README and docs/ from the results files that measured it.

A table lives in a page between two markers::

    <!-- table: speed-zen5 -->
    ...generated Markdown...
    <!-- /table -->

``registry.yaml`` (beside this file) says, for each name, which results files under docs/results/ it is
made from, the command that made them, which pages show it, and the benchmark function that renders it
(each benchmark renders the results files it writes). ``python -m benchmarks.render`` rewrites every
marked region; ``--check`` rewrites nothing and exits 1, listing the stale regions, when a committed table
differs from its rendering (tests/test_render_results.py runs it), so that a figure cannot drift from its
measurement. docs/results/README.md's index of the kept files is rendered the same way.

docs/benchmarks.md holds, per ISA level (the registry's ``isa_levels``), the latest run of each benchmark,
headed by a table of the machines its files recorded; the README's ``summary-isa`` has one row per level,
each cell naming the CPU its figures come from. A run that a later run of its level moved off the pages is
*history*: the results index shows it in full, under its CPU kind (``cpu_kinds``: each kind's machine
table, and ``summary-cpus``, one row per kind). A table whose runs a later run of the same CPU kind
replaced is *superseded*: it is on no page, its figures are quoted in CHANGELOG.md (which ``--check``
requires to name each of its files), and its files stay in the index, marked so, and must still render.

Usage::

    python -m benchmarks.render            # rewrite the tables
    python -m benchmarks.render --check    # exit 1 if a table is stale, naming it
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import attention, long_context, peers, training
from benchmarks.harness import ROOT, joined, table_lines, times

RESULTS = "docs/results"
REGISTRY = Path(__file__).resolve().parent / "registry.yaml"
MARKER = re.compile(r"<!-- table: (?P<name>[a-z0-9-]+) -->\n(?P<body>.*?)<!-- /table -->", re.DOTALL)
README = "README.md"
BENCHMARKS = "docs/benchmarks.md"
INDEX = f"{RESULTS}/README.md"
CHANGELOG = "CHANGELOG.md"
SUPERSEDED = re.compile(r"superseded by (?P<name>[a-z0-9-]+)")


@dataclass(frozen=True)
class Table:
    """One rendered table: its results files, the command that made them, and where it is shown."""

    name: str
    files: tuple[str, ...]  # paths under docs/results/
    pages: tuple[str, ...]  # paths from the repository root
    command: str
    render: Callable[[list[dict]], list[str]]  # the loaded files, in order -> Markdown lines
    #: The current table that replaced this one ("" while current): shown nowhere, quoted in CHANGELOG.md.
    superseded_by: str = ""
    #: An earlier run of its ISA level: shown in the results index's per-CPU history only.
    history: bool = False


@dataclass(frozen=True)
class Section:
    """A set of tables by the summary's parts (None: not measured): an ISA level of docs/benchmarks.md
    (its current run of each benchmark) or a CPU kind of the results index (every run on that kind)."""

    key: str  # its machine table, ``isa-KEY`` or ``cpu-KEY``
    name: str  # as its heading and the summary's row say it
    short: str = ""  # a CPU kind's name in the ISA summary's cells
    attention: str | None = None  # benchmarks.attention, one call, 1 row, C = 25, k = 32 (fp32 runs used)
    long: str | None = None  # benchmarks.long_context (timing files first)
    peers: str | None = None  # benchmarks.peers
    training: str | None = None  # benchmarks.training --parts step
    others: tuple[str, ...] = ()  # its other tables (machine table only)

    def parts(self) -> dict[str, str]:
        """The summary's parts this section measured, by part, in the summary's order."""
        named = {"attention": self.attention, "long": self.long, "peers": self.peers}
        named["training"] = self.training
        return {part: name for part, name in named.items() if name}

    def tables(self) -> tuple[str, ...]:
        """Every table of the section."""
        return tuple(dict.fromkeys((*self.parts().values(), *self.others)))


@dataclass(frozen=True)
class Registry:
    """``registry.yaml`` read: the measured tables, then the derived ones (machines, summaries)."""

    tables: tuple[Table, ...]
    levels: tuple[Section, ...]  # docs/benchmarks.md's sections, the README's speed table's rows
    kinds: tuple[Section, ...]  # the results index's per-CPU history
    #: file -> (what it is, the page that shows or cites it): kept files no table renders.
    extra_files: dict[str, tuple[str, str]]


# ---------------------------------------------------------------------------------------------------------
# The registry


def renderer(spec: str, options: dict[str, Any], where: str) -> Callable[[list[dict]], list[str]]:
    """``MODULE.FUNCTION`` of benchmarks/ with the entry's options bound."""
    module, _, function = spec.rpartition(".")
    try:
        found = getattr(importlib.import_module(f"benchmarks.{module}"), function, None) if module else None
    except ModuleNotFoundError:
        found = None
    if not callable(found):
        raise ValueError(f"{where}: table {spec!r} is no function of benchmarks/ (write MODULE.FUNCTION)")
    return functools.partial(found, **options)


def measured_table(entry: dict[str, Any]) -> Table:
    """One entry of ``tables``, checked: every key known, the status current, history or superseded."""
    where = f"{REGISTRY.name}: table {entry.get('name')!r}"
    keys = {"name", "status", "pages", "table", "options", "command", "files"}
    if unknown := set(entry) - keys:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(sorted(keys))})")
    status = entry.get("status", "")
    superseded = SUPERSEDED.fullmatch(status)
    if status not in ("current", "history") and superseded is None:
        raise ValueError(f"{where}: status must be current, history or 'superseded by NAME', got {status!r}")
    if status == "history" and tuple(entry.get("pages", ())) != (INDEX,):
        raise ValueError(f"{where}: a history table is shown in {INDEX} only")
    return Table(
        name=entry["name"],
        files=tuple(entry.get("files", ())),
        pages=tuple(entry.get("pages", ())),
        command=entry["command"],
        render=renderer(entry["table"], entry.get("options", {}), where),
        superseded_by=superseded["name"] if superseded else "",
        history=status == "history",
    )


def load_registry(path: Path = REGISTRY) -> Registry:
    """The registry's tables (the measured ones, each CPU kind's machine table, the README's summary)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    measured = tuple(measured_table(entry) for entry in data["tables"])
    names = [t.name for t in measured]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"{path.name}: table {twice[0]!r} is registered twice (a name is one table)")
    levels, kinds = (
        tuple(Section(**{**item, "others": tuple(item.get("others", ()))}) for item in data[key])
        for key in ("isa_levels", "cpu_kinds")
    )
    extra = {item["file"]: (item["what"], item["page"]) for item in data.get("extra_files", ())}
    return Registry(measured + derived_tables(measured, levels, kinds), levels, kinds, extra)


# ---------------------------------------------------------------------------------------------------------
# One section per CPU kind: its machine, and the README's one row per kind


def recorded(result: dict) -> dict:
    """What a results file says about its machine, whichever benchmark wrote it (None where it does not)."""
    machine, environment = result.get("machine", {}), result.get("environment", {})
    hardware = environment.get("hardware", {})
    kernels = result.get("kernels", {})
    return {
        "date": (result.get("date") or environment.get("date") or machine.get("date") or "")[:10] or None,
        "cpu": machine.get("processor") or machine.get("cpu") or hardware.get("cpu"),
        "kernels": kernels.get("kernels_cpu_isa") or result.get("kernels_cpu_isa"),
        "torch": result.get("torch_cpu_capability"),
        "threads": machine.get("threads")
        or result.get("threads")
        or environment.get("threads")
        or distinct([r.get("threads") for r in result.get("runs", []) if isinstance(r, dict)], None),
        "cores": machine.get("cpu_count") or environment.get("cpu_count"),
    }


def distinct(values: Sequence, missing: str | None = "not recorded") -> str | None:
    """The values' distinct texts, sorted and joined; ``missing`` where there is none."""
    found = sorted({str(v) for v in values if v is not None})
    return ", ".join(found) if found else missing


def machine_table(results: list[dict], tables: Sequence[tuple[str, int]]) -> list[str]:
    """One row per table of a CPU kind: its files' dates, CPU, kernel library, torch's ISA, threads, cores.

    ``tables`` names each table and how many of the files (in order) are its.
    """
    if sum(count for _, count in tables) != len(results):
        raise ValueError(f"machine_table: {len(results)} files for {tables}")
    rows, start = [], 0
    for name, count in tables:
        found = [recorded(r) for r in results[start : start + count]]
        start += count
        rows.append(
            [
                f"`{name}`",
                str(count),
                distinct(f["date"] for f in found),
                distinct(f["cpu"] for f in found),
                f"{distinct(f['kernels'] for f in found)} / {distinct(f['torch'] for f in found)}",
                f"{distinct(f['threads'] for f in found)} / {distinct(f['cores'] for f in found)}",
            ]
        )
    header = ["table", "files", "dates", "CPU as recorded", "kernels / torch's ISA", "threads / cores"]
    caption = (
        "As each results file recorded its machine (`x86_64_v4`: the AVX-512 kernel library, "
        '`x86_64_v3`: AVX2 + FMA); "not recorded": the benchmark did not write it then.'
    )
    return table_lines(header, "lrllll", rows) + ["", caption]


SUMMARY_LENGTHS = {"attention": (512, 4096), "long": (8192, 16384), "peers": (8192, 16384)}
SUMMARY_LENGTHS["training"] = (4096, 16384)


def summary_cell(part: str, results: list[dict]) -> str:
    """A kind's headline ratios of one part at the part's two lengths ("–" where not measured)."""
    lengths, suffix = SUMMARY_LENGTHS[part], ""
    if part == "attention":
        values = [attention.lowest_ratio(results, n) for n in lengths]
    elif part == "long":
        values = [long_context.proxy_speedup(results, n) for n in lengths]
    elif part == "peers":
        (report,) = results
        entries = [peers.proxy_ratios(report).get(str(n), {}) for n in lengths]
        values = [entry.get("vs_fastest") for entry in entries]
        fastest = joined(list(dict.fromkeys(entry.get("fastest_peer", "–") for entry in entries)))
        suffix = f" ({fastest}; OpenVINO {peers.openvino_precision(report)})"
    else:
        values = [training.step_speedup(results, n) for n in lengths]
    if all(v is None for v in values):
        return "–"
    return joined(["–" if v is None else times(v) for v in values]) + suffix


#: The summaries' columns after the first, and what their caption says of them.
SUMMARY_HEADER = [
    "one call, i-clustered × SDPA, 512 / 4,096 tokens",
    "whole model × unmodified, 8,192 / 16,384",
    "× fastest peer, 8,192 / 16,384",
    "training step × unmodified, 4,096 / 16,384",
    "dates",
]
SUMMARY_CAPTION = (
    "fp32, 2 threads. One call: 1 row, 12 heads × 64, C = 25, k = 32, the lower of the runs; whole model "
    "and peers: the MiniLM-16k proxy, one document at a time, `convert`'s defaults; training: a step of "
    "that proxy with a classification head; –: not measured"
)


def summary_table(
    results: list[dict], sections: Sequence[Section], counts: dict[str, int], cpus: dict[str, str]
) -> list[str]:
    """One row per section: its parts' headline ratios (files: each section's parts, in order); with
    ``cpus`` (table -> CPU kind), each cell names the CPU its figures come from."""
    rows, start = [], 0
    for section in sections:
        row, dates = [section.name], []
        for part in ("attention", "long", "peers", "training"):
            name = section.parts().get(part)
            if name is None:
                row.append("–")
                continue
            mine = results[start : start + counts[name]]
            start += counts[name]
            cell = summary_cell(part, mine)
            row.append(f"{cell}, {cpus[name]}" if cpus and cell != "–" else cell)
            dates += [recorded(r)["date"] for r in mine]
        row.append(distinct(dates))
        rows.append(row)
    if start != len(results):
        raise ValueError(f"summary_table: {len(results)} files, {start} read")
    if cpus:
        caption = (
            f"{SUMMARY_CAPTION}; each cell: the latest run of its ISA level, on the CPU it names (CUDA: not "
            "measured yet). The tables, commands and machines: docs/benchmarks.md; every CPU kind's: "
            "docs/results/README.md."
        )
        return table_lines(["ISA level", *SUMMARY_HEADER], "llllll", rows) + ["", caption]
    caption = f"{SUMMARY_CAPTION} on that CPU. Each CPU's tables and machine: below, and docs/benchmarks.md."
    return table_lines(["CPU", *SUMMARY_HEADER], "lrrrrl", rows) + ["", caption]


def derived_tables(
    measured: Sequence[Table], levels: Sequence[Section], kinds: Sequence[Section]
) -> tuple[Table, ...]:
    """Each ISA level's and each CPU kind's machine table, and their summaries (the README's per ISA
    level, the results index's per CPU kind), from their tables' files."""
    by_name = {t.name: t for t in measured}
    cpus = {name: kind.short or kind.name for kind in kinds for name in kind.tables()}
    out = []
    for prefix, page, sections in (("isa", BENCHMARKS, levels), ("cpu", INDEX, kinds)):
        for section in sections:
            mine = [by_name[name] for name in section.tables()]
            out.append(
                Table(
                    f"{prefix}-{section.key}",
                    tuple(file for t in mine for file in t.files),
                    (page,),
                    "(the files of the section's tables, as they recorded their machine)",
                    functools.partial(machine_table, tables=[(t.name, len(t.files)) for t in mine]),
                )
            )
    for name, page, sections, named in (("isa", README, levels, cpus), ("cpus", INDEX, kinds, {})):
        parts = [by_name[table] for section in sections for table in section.parts().values()]
        out.append(
            Table(
                f"summary-{name}",
                tuple(file for t in parts for file in t.files),
                (page,),
                "(the files of each section's tables)",
                functools.partial(
                    summary_table, sections=sections, counts={t.name: len(t.files) for t in parts}, cpus=named
                ),
            )
        )
    return tuple(out)


def index_table(registry: Registry) -> list[str]:
    """Every kept results file: which table renders it (and the command), or which page shows it.

    A superseded table's files are listed as such, cited by CHANGELOG.md, where their figures are quoted.
    """
    rows = []
    for entry in registry.tables:
        if entry.superseded_by:
            pages = f"[{CHANGELOG}](../../{CHANGELOG})"
            state = f"superseded by `{entry.superseded_by}`"
        else:
            pages = ", ".join(f"[{Path(d).name}](../../{d})" for d in entry.pages)
            state = "history" if entry.history else "current"
        files = "<br>".join(f"`{file}`" for file in entry.files)
        rows.append([files, f"`{entry.name}`", state, pages, f"`{entry.command}`"])
    for file, (what, page) in registry.extra_files.items():
        rows.append([f"`{file}`", "", "", f"[{Path(page).name}](../../{page})", what])
    return table_lines(["files", "table", "state", "cited by", "made by"], "lllll", rows)


# ---------------------------------------------------------------------------------------------------------
# Rendering and checking


def load(root: Path, entry: Table) -> list[dict]:
    """The entry's results files, parsed, in the registry's order."""
    return [json.loads((root / RESULTS / file).read_text(encoding="utf-8")) for file in entry.files]


def rendering(root: Path, entry: Table) -> str:
    """The region's body: the table, its caption and the files it came from."""
    lines = entry.render(load(root, entry))
    if entry.files:
        lines.append("Source: " + ", ".join(f"`{RESULTS}/{file}`" for file in entry.files) + ".")
        lines.append(f"Made by: `{entry.command}`.")
    return "\n" + "\n".join(lines) + "\n\n"


def render_document(
    root: Path, document: str, entries: Sequence[Table], registry: Registry
) -> tuple[str, str, list[str]]:
    """(current text, rendered text, problems) for one page."""
    text = (root / document).read_text(encoding="utf-8")
    by_name = {e.name: e for e in entries}
    superseded = {e.name: e.superseded_by for e in registry.tables if e.superseded_by}
    problems = []
    found = set()

    def replace(match: re.Match) -> str:
        name = match["name"]
        found.add(name)
        if name in superseded:
            problems.append(
                f"{document}: table {name!r} is superseded by {superseded[name]!r}: its region belongs in "
                f"no page (quote its figures in {CHANGELOG})"
            )
            return match[0]
        if name not in by_name:
            problems.append(f"{document}: table {name!r} is not registered for this document")
            return match[0]
        return f"<!-- table: {name} -->\n{rendering(root, by_name[name])}<!-- /table -->"

    new = MARKER.sub(replace, text)
    problems += [f"{document}: no region for table {n!r}" for n in by_name if n not in found]
    return text, new, problems


def superseded_problems(root: Path, registry: Registry) -> list[str]:
    """A superseded table names a current one, is on no page, is quoted in CHANGELOG.md and still renders."""
    current = {e.name for e in registry.tables if not e.superseded_by}
    changelog = (root / CHANGELOG).read_text(encoding="utf-8")
    problems = []
    for entry in registry.tables:
        if not entry.superseded_by:
            continue
        if entry.superseded_by not in current:
            problems.append(
                f"table {entry.name!r}: superseded by {entry.superseded_by!r}, not a current table"
            )
        if entry.pages:
            problems.append(f"table {entry.name!r} is superseded yet registered for {', '.join(entry.pages)}")
        problems += [
            f"{CHANGELOG} does not quote superseded table {entry.name!r}'s file {RESULTS}/{file}"
            for file in entry.files
            if f"{RESULTS}/{file}" not in changelog
        ]
        try:
            entry.render(load(root, entry))
        except (OSError, KeyError, ValueError, TypeError, IndexError) as error:
            problems.append(f"table {entry.name!r} (superseded) no longer renders: {error!r}")
    return problems


def run(root: Path, check: bool, registry: Registry | None = None) -> list[str]:
    """Render (or check) every page; returns the stale regions and other problems."""
    registry = registry or load_registry()
    index = Table("results-index", (), (INDEX,), "", lambda _: index_table(registry))
    pages: dict[str, list[Table]] = {}
    for entry in (*registry.tables, index):
        for page in entry.pages:
            pages.setdefault(page, []).append(entry)
    problems = superseded_problems(root, registry)
    for page, entries in pages.items():
        text, new, found = render_document(root, page, entries, registry)
        problems += found
        if new != text:
            if check:
                old = {m["name"]: m["body"] for m in MARKER.finditer(text)}
                current = {m["name"]: m["body"] for m in MARKER.finditer(new)}
                problems += [
                    f"{page}: table {n!r} differs from its results"
                    for n in current
                    if old.get(n) != current[n]
                ]
            else:
                (root / page).write_text(new, encoding="utf-8")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite (or ``--check``) every region; the problems on stderr, exit 1 if there are any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository root (default: this checkout)"
    )
    parser.add_argument("--registry", type=Path, default=REGISTRY, help="the registry (default: %(default)s)")
    args = parser.parse_args(argv)
    problems = run(args.root, args.check, load_registry(args.registry))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
