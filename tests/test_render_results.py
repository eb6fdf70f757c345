"""The README's and docs' tables are their results files' rendering, and the README states the defaults."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

import bert_cluster
from benchmarks import finetune_recovery, long_document_fidelity, long_document_training, render
from bert_cluster.config import ClusteredAttentionConfig

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = render.load_registry()

#: Pages of this repository's docs whose tables benchmarks/render.py owns (docs/embed.md is written by hand).
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "embed.md"),
    ROOT / "docs/results/README.md",
]
#: Issue 70's limits: the README is a user's page, docs/benchmarks.md the current run of each ISA level.
README_MAX_LINES = 250
BENCHMARKS_MAX_LINES = 400
INDEX = ROOT / "docs/results/README.md"


def test_the_committed_tables_equal_their_rendering():
    assert render.run(ROOT, check=True) == []


def test_the_registry_is_data_and_the_renderer_code_only():
    """Issue 70: which file feeds which table is registry.yaml's; render.py names no results file and stays
    under 700 lines (it was 2,553 with the registry written as code)."""
    source = (ROOT / "benchmarks/render.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) < 700
    literals = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)]
    assert not [v for v in literals if isinstance(v, str) and re.search(r"\.(json|png)$", v)]
    data = yaml.safe_load((ROOT / "benchmarks/registry.yaml").read_text(encoding="utf-8"))
    assert [entry["name"] for entry in data["tables"]] == [t.name for t in REGISTRY.tables][
        : len(data["tables"])
    ]
    assert {file for entry in data["tables"] for file in entry["files"]} <= {
        file for t in REGISTRY.tables for file in t.files
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "unknown keys ['colour']"),
        ({"status": "old"}, "status must be current, history or 'superseded by NAME', got 'old'"),
        (
            {"status": "history", "pages": ["docs/benchmarks.md"]},
            "a history table is shown in docs/results/README.md only",
        ),
        (
            {"table": "attention.no_such_table"},
            "table 'attention.no_such_table' is no function of benchmarks/",
        ),
        ({"table": "speed_table"}, "is no function of benchmarks/ (write MODULE.FUNCTION)"),
        ({"table": "nosuch.table"}, "table 'nosuch.table' is no function of benchmarks/"),
    ],
)
def test_a_registry_entry_that_is_wrong_is_refused_naming_it(tmp_path, change, message):
    data = yaml.safe_load((ROOT / "benchmarks/registry.yaml").read_text(encoding="utf-8"))
    data["tables"][0].update(change)
    path = tmp_path / "registry.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        render.load_registry(path)
    assert f"table {data['tables'][0]['name']!r}" in str(error.value)


def test_a_table_registered_twice_is_refused(tmp_path):
    data = yaml.safe_load((ROOT / "benchmarks/registry.yaml").read_text(encoding="utf-8"))
    data["tables"].append(dict(data["tables"][0]))
    path = tmp_path / "registry.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ValueError, match=f"table {data['tables'][0]['name']!r} is registered twice"):
        render.load_registry(path)


def copy_docs(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "CHANGELOG.md", tmp_path / "CHANGELOG.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_a_changed_figure_makes_the_check_fail_and_rendering_fixes_it(tmp_path, capsys):
    root = copy_docs(tmp_path)
    source = root / "docs/results/bench_attention_zen4/targets_fp32_1.json"
    result = json.loads(source.read_text(encoding="utf-8"))
    row = next(r for r in result["rows"] if r["n"] == 512 and r["method"] == "kernel-i-clustered")
    benchmarks = root / "docs/benchmarks.md"
    assert "1.56 / 1.46 (3.38× / 4.26×)" in benchmarks.read_text(encoding="utf-8")
    assert "| AVX-512 | 3.38× / 30.7×, Zen 4 |" in (root / "README.md").read_text(encoding="utf-8")
    row["median_ms"] = 2.1
    row["speedup_vs_sdpa"] = 2.5  # below the other run's 4.26: the summaries show the lower
    source.write_text(json.dumps(result), encoding="utf-8")

    assert render.main(["--check", "--root", str(root)]) == 1
    stale = capsys.readouterr().err
    assert "README.md: table 'summary-isa' differs" in stale
    assert "docs/benchmarks.md: table 'speed-zen4' differs" in stale
    assert "docs/results/README.md: table 'summary-cpus' differs" in stale
    assert "long-documents" not in stale  # only the tables made from that file

    assert render.main(["--root", str(root)]) == 0  # rewrites the regions
    assert "2.10 / 1.46 (2.50× / 4.26×)" in benchmarks.read_text(encoding="utf-8")
    assert "| AVX-512 | 2.50× / 30.7×, Zen 4 |" in (root / "README.md").read_text(encoding="utf-8")
    index = (root / "docs/results/README.md").read_text(encoding="utf-8")
    assert "| AMD EPYC Zen 4 (AVX-512) | 2.50× / 30.7× |" in index
    assert render.main(["--check", "--root", str(root)]) == 0


def test_a_hand_edited_table_makes_the_check_fail(tmp_path, capsys):
    root = copy_docs(tmp_path)
    page = root / "docs/fidelity.md"
    text = page.read_text(encoding="utf-8")
    assert "| 0.259 (0.315) |" in text
    page.write_text(text.replace("| 0.259 (0.315) |", "| 0.159 (0.315) |"), encoding="utf-8")
    assert render.main(["--check", "--root", str(root)]) == 1
    assert "docs/fidelity.md: table 'fidelity-inspect' differs" in capsys.readouterr().err


def test_a_missing_or_unknown_region_is_reported(tmp_path):
    root = copy_docs(tmp_path)
    page = root / "docs/benchmarks.md"
    text = page.read_text(encoding="utf-8")
    start = text.index("<!-- table: speed-zen3 -->")
    end = text.index("<!-- /table -->", start) + len("<!-- /table -->")
    unknown = "<!-- table: no-such-table -->\n<!-- /table -->"
    page.write_text(text[:start] + unknown + text[end:], encoding="utf-8")
    problems = render.run(root, check=True)
    assert "docs/benchmarks.md: no region for table 'speed-zen3'" in problems
    assert "docs/benchmarks.md: table 'no-such-table' is not registered for this document" in problems


SUPERSEDED = [t for t in REGISTRY.tables if t.superseded_by]


def test_superseded_tables_are_on_no_page_and_quoted_in_the_changelog():
    assert SUPERSEDED, "the registry marks no table superseded"
    shown = {m["name"] for page in PAGES for m in render.MARKER.finditer(page.read_text("utf-8"))}
    current = {t.name for t in REGISTRY.tables if not t.superseded_by}
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    for entry in SUPERSEDED:
        assert entry.name not in shown and not entry.pages
        assert entry.superseded_by in current
        assert all(f"docs/results/{source}" in changelog for source in entry.files)
        index_row = next(r for r in render.index_table(REGISTRY) if f"`{entry.name}`" in r)
        assert f"superseded by `{entry.superseded_by}`" in index_row and "CHANGELOG.md" in index_row


def test_a_superseded_table_back_on_a_page_or_missing_from_the_changelog_fails_the_check(tmp_path):
    root = copy_docs(tmp_path)
    entry = SUPERSEDED[0]
    source = f"docs/results/{entry.files[0]}"
    changelog = root / "CHANGELOG.md"
    changelog.write_text(changelog.read_text(encoding="utf-8").replace(source, "a file"), encoding="utf-8")
    page = root / "docs/benchmarks.md"
    page.write_text(
        page.read_text(encoding="utf-8") + f"\n<!-- table: {entry.name} -->\n<!-- /table -->\n",
        encoding="utf-8",
    )
    problems = render.run(root, check=True)
    assert f"CHANGELOG.md does not quote superseded table {entry.name!r}'s file {source}" in problems
    assert any(p.startswith(f"docs/benchmarks.md: table {entry.name!r} is superseded by") for p in problems)
    assert render.main(["--root", str(root)]) == 1  # rendering refuses it too, naming it


def test_a_superseded_tables_files_must_still_render(tmp_path):
    root = copy_docs(tmp_path)
    entry = SUPERSEDED[0]
    (root / "docs/results" / entry.files[0]).write_text("{}", encoding="utf-8")
    problems = render.run(root, check=True)
    assert any(p.startswith(f"table {entry.name!r} (superseded) no longer renders") for p in problems)


def sections(text: str, prefix: str) -> dict[str, list[str]]:
    """A page's regions by the section (``PREFIX-KEY`` machine region) they follow."""
    found: dict[str, list[str]] = {}
    key = None
    for match in render.MARKER.finditer(text):
        if match["name"].startswith(f"{prefix}-"):
            key = match["name"].removeprefix(f"{prefix}-")
            found[key] = []
        elif key is not None:
            found[key].append(match["name"])
    return found


def test_each_isa_level_has_one_section_holding_its_current_run_of_each_benchmark():
    text = (ROOT / "docs/benchmarks.md").read_text(encoding="utf-8")
    found = sections(text, "isa")
    levels = REGISTRY.levels
    assert [level.name for level in levels] == ["AVX-512", "AVX2"]  # CUDA: when a GPU is lent
    assert list(found) == [level.key for level in levels]
    for level in levels:
        assert sorted(found[level.key]) == sorted(level.tables()), level.key
        assert f"\n## {level.name}\n" in text  # headed by the ISA level
    on_the_page = {t.name for t in REGISTRY.tables if "docs/benchmarks.md" in t.pages}
    in_a_section = {n for names in found.values() for n in names} | {f"isa-{k.key}" for k in levels}
    assert on_the_page == in_a_section  # no benchmark table outside an ISA level's section
    assert len(text.splitlines()) < BENCHMARKS_MAX_LINES


def test_each_cpu_kind_has_one_section_in_the_index_holding_its_history():
    """Issue 70: per-CPU history lives in the results index: every kind under its heading, opened by its
    machine table, with each of its history tables (a run its ISA level's later run moved off the pages)."""
    text = INDEX.read_text(encoding="utf-8")
    found = sections(text, "cpu")
    kinds = REGISTRY.kinds
    assert list(found) == [kind.key for kind in kinds]
    current = {name for level in REGISTRY.levels for name in level.tables()}
    history = {t.name for t in REGISTRY.tables if t.history}
    assert history and not history & current
    for kind in kinds:
        assert f"\n### {kind.name}\n" in text
        assert {name for name in found[kind.key] if not name.startswith("cpu-")} == set(
            kind.tables()
        ) & history
    assert {t.name for t in REGISTRY.tables if "docs/results/README.md" in t.pages and t.history} == history
    assert all(t.pages == ("docs/results/README.md",) for t in REGISTRY.tables if t.history)


def summary_rows(text: str, name: str) -> list[list[str]]:
    start = text.index(f"<!-- table: {name} -->")
    region = text[start : text.index("<!-- /table -->", start)]
    return [[c.strip() for c in cells(line)] for line in region.splitlines() if line[:2] == "| "][1:]


def test_the_readme_speed_table_has_one_row_per_isa_level_naming_each_cells_cpu(tmp_path):
    root = copy_docs(tmp_path)
    rows = summary_rows((root / "README.md").read_text(encoding="utf-8"), "summary-isa")
    assert [row[0] for row in rows] == [level.name for level in REGISTRY.levels]
    avx2 = [
        "AVX2",
        "3.15× / 22.9×, Zen 3",
        "4.22× / {}, Zen 3",
        "4.27× / 5.80× (torch; OpenVINO default), Zen 3",
    ]
    assert rows[1][:4] == [cell.replace("{}", "6.83×") for cell in avx2] and rows[1][4] == "–"
    assert rows[0][4] == "2.24× / 5.89×, Zen 4"  # the latest AVX-512 training step: another CPU's
    source = root / "docs/results/long_context_zen3_1207/long_fp32.json"
    result = json.loads(source.read_text(encoding="utf-8"))
    next(r for r in result["rows"] if r["length"] == 16384)["speedup"] = 6.5
    source.write_text(json.dumps(result), encoding="utf-8")
    assert render.main(["--root", str(root)]) == 0
    rows = summary_rows((root / "README.md").read_text(encoding="utf-8"), "summary-isa")
    assert rows[1][:4] == [cell.replace("{}", "6.50×") for cell in avx2]


def test_the_index_summary_has_one_row_per_cpu_kind_from_its_files():
    rows = summary_rows(INDEX.read_text(encoding="utf-8"), "summary-cpus")
    assert [row[0] for row in rows] == [kind.name for kind in REGISTRY.kinds]
    zen1 = next(row for row in rows if row[0] == "AMD EPYC Zen 1 (AVX2)")
    assert zen1[1:4] == ["3.13× / 30.1×", "4.46× / 7.50×", "4.49× / 7.27× (torch; OpenVINO default)"]


def test_the_machine_table_is_what_the_files_recorded(tmp_path):
    root = copy_docs(tmp_path)
    source = root / "docs/results/bench_attention_zen3_1207/targets_fp32_2.json"
    result = json.loads(source.read_text(encoding="utf-8"))
    result["date"] = "2027-01-02T00:00:00+00:00"
    result["machine"]["processor"] = "AMD EPYC 7B13"
    source.write_text(json.dumps(result), encoding="utf-8")
    assert render.main(["--root", str(root)]) == 0
    for page, name in (("docs/results/README.md", "cpu-zen3"), ("docs/benchmarks.md", "isa-avx2")):
        text = (root / page).read_text(encoding="utf-8")
        start = text.index(f"<!-- table: {name} -->")
        region = text[start : text.index("<!-- /table -->", start)]
        assert (
            "| `speed-zen3` | 4 | 2026-12-07, 2027-01-02 | AMD EPYC, AMD EPYC 7B13 | x86_64_v3 / AVX2 |"
            in region
        )
        assert "| `long-zen3` | 2 | 2026-12-07 | not recorded |" in region  # long_context records no CPU


@pytest.mark.parametrize(("recorded", "shown"), [(None, "f32"), ("default", "default"), ("f32", "f32")])
def test_the_peers_tables_name_openvinos_precision(recorded, shown, tmp_path):
    """A file from before --openvino-precision ran f32 (the script's fixed hint then) and says so."""
    root = copy_docs(tmp_path)
    source = root / "docs/results/peers_icelake/bench_peers.json"
    report = json.loads(source.read_text(encoding="utf-8"))
    assert "openvino_precision" not in report  # the committed runs predate the option
    if recorded is not None:
        report["openvino_precision"] = recorded
    source.write_text(json.dumps(report), encoding="utf-8")
    assert render.main(["--root", str(root)]) == 0
    text = (root / "docs/results/README.md").read_text(encoding="utf-8")
    start = text.index("<!-- table: peers-icelake -->")
    region = text[start : text.index("<!-- /table -->", start)]
    assert f"| openvino ({shown}) |" in region
    assert f"OpenVINO 2026.4.1 ({shown}: " in region
    assert f"4.22× / 6.89× (torch; OpenVINO {shown})" in text  # the index's summary per CPU kind


def regions(text: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in render.MARKER.finditer(text)]


def cells(line: str) -> list[str]:
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_is_rendered_and_well_formed(page):
    text = page.read_text(encoding="utf-8")
    spans = regions(text)
    offset = 0
    for line in text.splitlines(keepends=True):
        if line.startswith("|"):
            assert any(a <= offset < b for a, b in spans), f"a table outside a rendered region: {line!r}"
        offset += len(line)
    for start, end in spans:
        rows = [line for line in text[start:end].splitlines() if line.startswith("|")]
        assert len(rows) >= 3, text[start:end][:80]
        width = len(cells(rows[0]))
        assert all(re.fullmatch(r"-{3,}:?", c) for c in cells(rows[1])), rows[1]
        assert [len(cells(r)) for r in rows] == [width] * len(rows), rows[0]
    # A CommonMark parser with GitHub's tables sees one table per region, every row of it a table row.
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    assert sum(t.type == "table_open" for t in tokens) == len(spans)
    table_lines = sum(line.startswith("|") for line in text.splitlines())
    assert sum(t.type == "tr_open" for t in tokens) == table_lines - len(spans)  # less the rules


def test_every_kept_results_file_is_indexed_and_every_indexed_one_exists():
    folder = ROOT / render.RESULTS
    kept = {
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.parts[len(folder.parts)] != "peers" and p.name != "README.md"
    }
    indexed = {s for t in REGISTRY.tables for s in t.files} | set(REGISTRY.extra_files)
    assert all((folder / name).is_file() for name in indexed)
    assert kept == {name for name in indexed if not name.startswith("peers/")}  # peers/: bench_peers.py's


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_anchors_resolve(page):
    text = page.read_text(encoding="utf-8")
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if "://" in target:
            continue
        linked = page.parent / target if target else page
        assert linked.exists(), target
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{target}#{anchor}"


def test_the_readme_fits_its_budget():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < README_MAX_LINES


def stated_preset(comment: str) -> dict:
    """The keyword arguments of the ClusteredAttentionConfig(...) call under a README comment."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(comment))
    end = next(i for i in range(index + 1, len(lines)) if lines[i].rstrip().endswith(")"))
    call = ast.parse("\n".join(lines[index + 1 : end + 1])).body[0].value
    assert call.func.id == "ClusteredAttentionConfig"
    return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}


CONVERT = "# convert's preset, ClusteredAttentionConfig.for_convert()"
EVALUATOR = "# the evaluator's preset, ClusteredAttentionConfig.for_evaluation()"


def test_the_readme_states_converts_preset():
    preset = dataclasses.asdict(ClusteredAttentionConfig.for_convert())
    assert stated_preset(CONVERT) == preset
    assert preset["min_length"] == "auto"


def test_the_readme_states_the_evaluators_preset():
    preset = dataclasses.asdict(ClusteredAttentionConfig.for_evaluation())
    assert stated_preset(EVALUATOR) == preset
    assert preset["min_length"] == 0


def test_convert_applies_the_preset_the_readme_states():
    """A model converted with no settings carries exactly the README's convert preset."""
    from helpers import tiny_bert_config
    from transformers import BertModel

    model = BertModel(tiny_bert_config()).eval()
    bert_cluster.convert(model)
    stated = stated_preset(CONVERT)
    stored = model.config.clustered_attention
    assert {name: stored[name] for name in stated} == stated


def recovery_result(clustered_c10: list[float]) -> dict:
    """A finetune_recovery.py results file: one task, a seed per value of the clustered run at C = 10."""

    def scored(unmodified: float, c10: float, c25: float) -> dict:
        return {"unmodified": {"accuracy": unmodified}, "C=10": {"accuracy": c10}, "C=25": {"accuracy": c25}}

    seeds = {
        str(seed): {
            "clustered": {
                "steps": 156,
                "scores": scored(56.0 + seed, value, 55.5),
                "notes": {"saved converted": ""},
            },
            "exact": {"steps": 156, "scores": scored(56.5, 54.0, 56.0)},
        }
        for seed, value in enumerate(clustered_c10)
    }
    return {
        "settings": {"train_clusters": 10, "score_clusters": [10, 25], "target": 0.5, "epochs": 1.0,
                     "max_steps": None, "learning_rate": None, "batch_size": 16, "max_length": 256},
        "environment": {"hardware": {"cpu": "AMD EPYC", "torch_threads": 2}, "date": "2026-12-04T23:00:00"},
        "tasks": {"rte": {"original": {"scores": scored(55.0, 53.0, 55.0)}, "seeds": seeds}},
    }  # fmt: skip


def recovery_rows(result: dict) -> dict[str, list[str]]:
    """The rendered recovery table's rows by their model cell."""
    lines = finetune_recovery.recovery_table([result])
    cells = [
        line.removeprefix("| ").removesuffix(" |").split(" | ") for line in lines if line.startswith("| rte")
    ]
    return {row[2]: row for row in cells}


def test_the_recovery_table_averages_seeds_and_marks_the_target():
    """Over seeds the mean ± sample std and the change against the checkpoint's unmodified score; the
    clustered run's C = 10 bold when within the target of it, "missed" when not; the seeds that meet it."""
    rows = recovery_rows(recovery_result([54.0, 55.0]))
    clustered = rows["fine-tuned, C = 10 in the loop (2 seeds)"]
    assert clustered[4] == "**54.50 ± 0.71 (-0.50)** (1/2 seeds)"  # the mean within 0.5 of 55.0: met
    assert rows["checkpoint"][4] == "53.00 (-2.00), missed"
    assert rows["control: fine-tuned, exact (2 seeds)"][3] == "56.50 ± 0.00 (+1.50)"
    missed = finetune_recovery.recovery_table([recovery_result([54.0, 54.9])])
    assert any("54.45 ± 0.64 (-0.55), missed (1/2 seeds)" in line for line in missed)


def test_the_recovery_table_marks_the_target_wherever_it_holds():
    """Issue 67: the control and the checkpoint meet the target too where they score within it at C = 10; a
    table that marks only the adapted arm credits the adaptation with what its control shows."""
    result = recovery_result([54.6, 54.8])
    for seed in result["tasks"]["rte"]["seeds"].values():
        seed["exact"]["scores"]["C=10"]["accuracy"] = 54.9
    rows = recovery_rows(result)
    assert rows["control: fine-tuned, exact (2 seeds)"][4] == "**54.90 ± 0.00 (-0.10)** (2/2 seeds)"
    assert rows["fine-tuned, C = 10 in the loop (2 seeds)"][4] == "**54.70 ± 0.14 (-0.30)** (2/2 seeds)"
    result["tasks"]["rte"]["original"]["scores"]["C=10"]["accuracy"] = 54.5
    assert recovery_rows(result)["checkpoint"][4] == "**54.50 (-0.50)**"


def test_the_recovery_table_pairs_each_seed_with_its_control():
    """The paired row: the adapted arm minus the control, seed by seed, mean ± std, only where both ran."""
    result = recovery_result([54.0, 55.5])
    result["tasks"]["rte"]["seeds"]["1"]["exact"]["scores"]["C=10"]["accuracy"] = 55.0
    paired = recovery_rows(result)["paired: C = 10 in the loop − exact, per seed"]
    assert paired[4] == "+0.25 ± 0.35 (+0.00, +0.50)"
    assert paired[5] == "-0.50 ± 0.00 (-0.50, -0.50)"
    assert paired[3] == "+0.00 ± 0.71 (-0.50, +0.50)"  # unmodified 56 + seed against 56.5
    del result["tasks"]["rte"]["seeds"]["0"]["exact"]
    assert recovery_rows(result)["paired: C = 10 in the loop − exact, per seed"][4] == "+0.50 (+0.50)"
    del result["tasks"]["rte"]["seeds"]["1"]["exact"]
    assert not any(name.startswith("paired") for name in recovery_rows(result))


def test_the_recovery_table_averages_hash_seeds_and_shows_how_far_weights_moved():
    """Scored with several hash seeds (``C=10 seed=S``): a seed's score is their mean, their spread a column;
    each arm's weight displacement (L2) over seeds; a third arm, the control with dropout, gets its rows."""
    result = recovery_result([54.0, 55.0])
    result["settings"]["score_seeds"] = [0, 1, 2]
    result["settings"]["distill"] = 1.0

    def hashed(scores: dict, shift: float) -> dict:
        out = {"unmodified": scores["unmodified"]}
        for column in ("C=10", "C=25"):
            for seed, offset in enumerate((-shift, 0.0, shift)):
                out[f"{column} seed={seed}"] = {"accuracy": scores[column]["accuracy"] + offset}
        return out

    entry = result["tasks"]["rte"]
    entry["original"]["scores"] = hashed(entry["original"]["scores"], 1.0)
    for number, seed in entry["seeds"].items():
        seed["exact-dropout"] = {"steps": 156, "scores": scored_like(seed["exact"]["scores"], 0.5)}
        for arm, distance in (("clustered", 0.3), ("exact", 0.2), ("exact-dropout", 0.25)):
            seed[arm]["scores"] = hashed(seed[arm]["scores"], 0.5)
            seed[arm]["displacement"] = {"all": distance + int(number) / 10}
    lines = finetune_recovery.recovery_table([result])
    assert lines[0].endswith("| hash seeds' std, C = 10 | weights moved (L2) |")
    rows = {line.split(" | ")[2]: line.split(" | ") for line in lines if line.startswith("| rte")}
    assert rows["checkpoint"][4:] == ["53.00 (-2.00), missed", "55.00 (+0.00)", "1.00", "0 |"]
    clustered = rows["distilled, C = 10 in the loop (2 seeds)"]
    assert clustered[4] == "**54.50 ± 0.71 (-0.50)** (1/2 seeds)" and clustered[6:] == [
        "0.50",
        "0.35 ± 0.07 |",
    ]
    dropout = rows["control: distilled, exact, dropout on (2 seeds)"]
    assert dropout[4] == "**54.50 ± 0.00 (-0.50)** (2/2 seeds)"
    assert rows["paired: C = 10 in the loop − exact-dropout, per seed"][4] == "+0.00 ± 0.71 (-0.50, +0.50)"
    assert "in the student only in the control with dropout on" in lines[-1]


def scored_like(scores: dict, shift: float) -> dict:
    """``scores`` with every value moved by ``shift``."""
    return {column: {k: v + shift for k, v in metrics.items()} for column, metrics in scores.items()}


def test_a_recovery_run_in_parts_shows_the_seeds_each_arm_has():
    """finetune_recovery.py --resume: a seed whose control is still to come counts for its clustered row."""
    result = recovery_result([54.0, 55.0])
    seeds = result["tasks"]["rte"]["seeds"]
    del seeds["1"]["exact"]

    def models() -> list[str]:
        lines = finetune_recovery.recovery_table([result])
        return [line.split(" | ")[2] for line in lines if line.startswith("| rte")]

    clustered, control = "fine-tuned, C = 10 in the loop", "control: fine-tuned, exact"
    paired = "paired: C = 10 in the loop − exact, per seed"
    assert models() == ["checkpoint", f"{clustered} (2 seeds)", f"{control} (one seed)", paired]
    assert "**Partial**" in finetune_recovery.recovery_table([result])[-1]
    result["tasks"]["rte"]["seeds"] = {"0": {"clustered": seeds["0"]["clustered"]}}
    assert models() == ["checkpoint", f"{clustered} (one seed)"]
    result["settings"]["seeds"] = 2  # asked for two, holds one
    assert (
        "each row counts the seeds it holds of the 2 asked" in finetune_recovery.recovery_table([result])[-1]
    )
    complete = recovery_result([54.0, 55.0])
    complete["settings"]["seeds"] = 2
    assert "Partial" not in finetune_recovery.recovery_table([complete])[-1]


def test_a_clustered_arm_scored_before_the_revert_fix_has_no_unmodified_cell():
    """Runs without notes were scored "unmodified" as their saved C = 10 model: left out of that cell only."""
    result = recovery_result([54.0, 55.0])

    def clustered_row() -> list[str]:
        lines = finetune_recovery.recovery_table([result])
        assert lines[-1].endswith(finetune_recovery.UNREVERTED) == any(
            "notes" not in seed["clustered"] for seed in result["tasks"]["rte"]["seeds"].values()
        )
        return next(line.split(" | ") for line in lines if "in the loop" in line)

    assert clustered_row()[3] == "56.50 ± 0.71 (+1.50)"
    del result["tasks"]["rte"]["seeds"]["0"]["clustered"]["notes"]
    row = clustered_row()
    assert row[3] == "57.00 (+2.00)" and row[4] == "**54.50 ± 0.71 (-0.50)** (1/2 seeds)"  # seed 1 only
    del result["tasks"]["rte"]["seeds"]["1"]["clustered"]["notes"]
    assert clustered_row()[3] == "–"


def test_a_recovery_run_in_parts_names_each_machine_and_its_dates():
    """Parts run on other machines (--resume appends each part's environment): the caption names every CPU
    and the span of dates, and the seeds the run asks for."""
    result = recovery_result([54.0])
    result["settings"]["seeds"] = 1
    caption = finetune_recovery.recovery_table([result])[-1]
    assert "seed 0;" in caption and "AMD EPYC, 2 threads; 2026-12-04." in caption
    result["settings"]["seeds"] = 3
    result["parts"] = [{"hardware": {"cpu": "Intel Xeon", "torch_threads": 2}, "date": "2026-12-06T01:00:00"}]
    caption = finetune_recovery.recovery_table([result])[-1]
    assert "seeds 0-2;" in caption
    assert "AMD EPYC, 2 threads; Intel Xeon, 2 threads; 2026-12-04 to 2026-12-06." in caption


def long_document_result(exact: list[float], clustered: list[float]) -> dict:
    """A long_document_training.py results file: R@1 (and MRR@10 = R@1 + 10) at budgets 0, 100, 200 s."""

    def points(values: list[float]) -> list[dict]:
        return [
            {"budget": budget, "seconds": float(budget), "step": budget // 10, "R@1": r, "MRR@10": r + 10}
            for budget, r in zip((0, 100, 200), values, strict=True)
        ]

    result = {
        "settings": {"batch_size": 4, "learning_rate": 2e-5, "seed": 0, "length": 4096, "clusters": None,
                     "mode": None, "attention_dropout": 0.0},
        "data": {"train_pairs": 5696, "held_out_questions": 4874},
        "variants": {"exact": {"points": points(exact)}, "clustered": {"points": points(clustered)}},
        "environment": {"processor": "AMD EPYC", "kernels_cpu_isa": "x86-64-v4", "threads": 2,
                        "date": "2026-12-05T03:00:00+00:00"},
    }  # fmt: skip
    result["verdicts"] = long_document_training.verdicts(result)
    return result


def test_the_long_document_table_reads_the_verdicts_off_the_scores():
    lines = long_document_fidelity.long_document_training_table(
        [long_document_result([50, 55, 60], [50, 61, 66])]
    )
    rows = [line.split(" | ") for line in lines[2:5]]  # below the header and its rule
    assert [row[0] for row in rows] == ["| untrained", "| 100", "| 200"]
    assert rows[1][1:3] == ["55.0", "**61.0**"] and rows[2][3:5] == ["70.0", "76.0"]
    caption = lines[-1]
    assert "at every budget: **yes**" in caption and "reached at 100 s of the exact run's 200 s" in caption
    assert "target half: **met**" in caption and "AMD EPYC, kernels x86-64-v4, 2 threads" in caption
    assert "attention dropout 0, seed 0" in caption
    behind = long_document_fidelity.long_document_training_table(
        [long_document_result([50, 55, 60], [50, 54, 59])]
    )
    assert "at every budget: **no**" in behind[-1] and "not reached within the budgets" in behind[-1]
    assert "target half: **missed**" in behind[-1] and not any("**5" in line for line in behind[:-1])


def test_the_long_document_table_of_several_seeds_shows_their_mean_and_judges_it():
    first = long_document_result([50, 55, 60], [50, 61, 59])  # behind at 200 s on its own
    second = long_document_result([50, 55, 60], [50, 63, 65])
    second["settings"]["seed"] = 1
    assert first["verdicts"]["at_least_exact_at_every_budget"] is False
    lines = long_document_fidelity.long_document_training_table([first, second])
    rows = [line.split(" | ") for line in lines[2:5]]
    assert rows[1][1:3] == ["55.0 (55.0 / 55.0)", "**62.0 (61.0 / 63.0)**"]
    assert rows[2][2] == "**62.0 (59.0 / 65.0)**" and rows[2][5] == "20, 20 / 20, 20 |"
    caption = lines[-1]
    assert "seeds 0, 1)" in caption and "at every budget: **yes**" in caption
    assert "reached at 100 s of the exact run's 200 s, target half: **met**" in caption
    assert "seed 0: every budget no, half met; seed 1: every budget yes, half met." in caption
    worse = long_document_result([50, 55, 60], [50, 50, 58])
    worse["settings"]["seed"] = 1
    behind = long_document_fidelity.long_document_training_table([first, worse])[-1]
    assert "at every budget: **no**" in behind and "not reached within the budgets" in behind


def test_the_long_document_table_shows_the_clustered_copies_scored_exact_when_the_run_has_them():
    plain = long_document_fidelity.long_document_training_table(
        [long_document_result([50, 55, 60], [49, 54, 61])]
    )
    assert "scored exact" not in "\n".join(plain)
    result = long_document_result([50, 55, 60], [49, 54, 61])
    for point, rescored in zip(result["variants"]["clustered"]["points"], (50, 56, 62), strict=True):
        point["exact_attention"] = {"R@1": rescored, "MRR@10": rescored + 10}
    lines = long_document_fidelity.long_document_training_table([result])
    assert lines[0].endswith("| clustered R@1, scored exact |")
    rows = [line.split(" | ") for line in lines[2:5]]
    assert [row[-1] for row in rows] == ["50.0 |", "56.0 |", "62.0 |"]
    assert rows[1][1:3] == ["55.0", "54.0"]  # the verdicts stay on each model's own attention
    assert "`--score-exact-too`" in lines[-1] and "at every budget: **no**" in lines[-1]


def test_the_claim_table_shows_every_run_and_states_the_verdict():
    """Issue 67: one row per run (its CPU, each budget's clustered minus exact R@1, the steps, its own two
    verdicts), then every run together; the verdict "not decided", with no split chosen after the data."""
    behind_then_ahead = long_document_result([50, 55, 60], [50, 54, 61])
    ahead_twice = long_document_result([50, 55, 60], [50, 56, 62])  # at least exact at every budget
    ahead_twice["settings"]["seed"] = 1
    behind_then_ahead["settings"]["questions_per_article"] = 16  # the other: 1, the first run's recipe
    lines = long_document_fidelity.long_document_claim_table(
        [behind_then_ahead, ahead_twice], ["Zen 1", "Xeon"]
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:-2]]
    assert rows[0] == ["Zen 1", "0", "100 / 200", "-1.00 / +1.00", "10 / 20 vs 10 / 20", "missed", "missed"]
    assert rows[1][:4] == ["Xeon, 1 question per article", "1", "100 / 200", "+1.00 / +2.00"]
    assert rows[1][5:] == ["met", "missed"]
    assert rows[2] == ["all 2 runs", "", "4 budgets", "mean +0.75, -1.00 to +2.00; at least exact at 3 of 4",
                       "", "1 of 2", "0 of 2 (both: 0)"]  # fmt: skip
    assert "Verdict: **not decided**." in lines[-1] and "both ways on every CPU kind" not in lines[-1]
    assert "≥" not in "\n".join(lines)  # no split of the budgets chosen after the data
    ahead_twice["variants"]["clustered"]["points"][1]["R@1"] = 54.0  # now behind at 100 s on the Xeon too
    assert (
        "The difference goes both ways on every CPU kind (2)."
        in long_document_fidelity.long_document_claim_table(
            [behind_then_ahead, ahead_twice], ["Zen 1", "Xeon"]
        )[-1]
    )


def test_the_rescored_table_shows_the_approximations_cost_and_whether_the_rerun_repeated_the_first():
    first = long_document_result([50, 55, 60], [49, 54, 61])
    rerun = long_document_result([50, 55, 60], [49, 54, 61])
    del rerun["variants"]["exact"]
    for point, rescored in zip(rerun["variants"]["clustered"]["points"], (50, 56, 60.5), strict=True):
        point["exact_attention"] = {"R@1": rescored, "MRR@10": rescored + 10}
    lines = long_document_fidelity.long_document_rescored_table([first, rerun])
    rows = [line.split(" | ") for line in lines[2:5]]
    assert rows[1][1:] == ["55.00 (10)", "54.00 (10)", "56.00", "+2.00", "+1.00 |"]
    assert rows[2][4:] == ["-0.50", "+0.50 |"]
    assert "equal the first run's: **yes**" in lines[-1] and "4,874 held-out questions" in lines[-1]
    rerun["variants"]["clustered"]["points"][2]["R@1"] = 61.02
    assert (
        "equal the first run's: **no**"
        in long_document_fidelity.long_document_rescored_table([first, rerun])[-1]
    )


def test_the_fidelity_table_reads_each_setting_against_exact():
    def row(setting: str, training: float, held_out: float, seconds: float, same: bool = True) -> dict:
        split = {"cosine_to_exact": 0.99, "questions_exact": same, "gained": 20, "lost": 33}
        return {
            "setting": setting, "clusters": 71, "topk": 91, "forward_backward_seconds": seconds,
            "training": {"R@1": training, **split}, "held_out": {"R@1": held_out, **split},
        }  # fmt: skip

    result = {
        "settings": {"length": 4096},
        "data": {"training": {"questions": 5696}, "held_out": {"questions": 4874}},
        "rows": [row("exact", 81.69, 79.18, 17.0), row("defaults", 81.57, 78.91, 6.8)],
        "environment": {"processor": "AMD EPYC", "kernels_cpu_isa": "x86_64_v3", "threads": 2,
                        "date": "2026-12-06T10:00:00+00:00"},
    }  # fmt: skip
    lines = long_document_fidelity.long_document_fidelity_table([result])
    defaults = [cell.strip() for cell in cells(lines[3])]
    assert defaults[:6] == ["`defaults`", "71 / 91", "81.57", "-0.12", "78.91", "-0.27"]
    assert defaults[6:] == ["+20 / -33", "0.9900", "6.80", "2.50×"]
    assert [cell.strip() for cell in cells(lines[2])[1:4]] == ["-", "81.69", ""]
    assert "equal the unmodified ones: **yes**" in lines[-1]
    result["rows"][1]["held_out"]["questions_exact"] = False
    assert "**no**" in long_document_fidelity.long_document_fidelity_table([result])[-1]
