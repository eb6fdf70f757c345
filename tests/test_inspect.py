"""``bert_cluster.inspection`` and ``bert-cluster inspect``: the per layer and head numbers, checked against
direct computations, the model left as it was, the heatmap, and the CLI's errors and JSON."""

from __future__ import annotations

import json
import math

import helpers
import pytest
import torch
from typer.testing import CliRunner

from bert_cluster import dispatch, inspection
from bert_cluster import reference as ref
from bert_cluster.attention import clustered_attention, hash_planes
from bert_cluster.cli import app
from bert_cluster.config import ClusteredAttentionConfig

runner = CliRunner()
MODES = ["i-clustered", "i-clustered+", "clustered"]
#: Relative error of the reported numbers against the direct computation (both float32 sums of the same
#: terms in another order). Measured max 2e-7.
SUM_RTOL = 1e-5
#: With k >= N every mode but plain clustered is exact attention: measured relative error <= 3e-7.
EXACT_ERROR = 1e-5


def inputs(rows=2, heads=3, n=40, dk=16, seed=0):
    """Random q, k, v with a sharp softmax, the second row left-padded by 7."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, n, dk, generator=g) * 1.5 for _ in range(3))
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1:, :7] = False
    return q, k, v, valid


def reports(config, q, k, v, valid, layer=0, scaling=0.25):
    totals = inspection._Totals()
    inspection.inspect_layer(totals, layer, q, k, v, valid, config, scaling)
    return totals.reports(with_mass=config.mode != "clustered")


@pytest.mark.parametrize("mode", MODES)
def test_relative_error_is_the_frobenius_error_over_valid_queries(mode):
    q, k, v, valid = inputs()
    config = ClusteredAttentionConfig(clusters=5, topk=4, mode=mode, backend="reference")
    found = reports(config, q, k, v, valid)
    approximate = clustered_attention(q, k, v, valid, config, scaling=0.25, layer=0)
    exact = ref.exact_attention(q, k, v, valid, 0.25)
    keep = valid[:, None, :, None]
    error = ((approximate - exact) * keep).pow(2).sum((0, 2, 3))
    norm = (exact * keep).pow(2).sum((0, 2, 3))
    expected = (error / norm).sqrt()
    assert [(r.layer, r.head) for r in found] == [(0, h) for h in range(3)]
    for report in found:
        assert report.relative_error == pytest.approx(float(expected[report.head]), rel=SUM_RTOL)
        assert report.relative_error > 0.01  # C=5 on 33-40 tokens is far from exact
        assert report.clustered_sequences == 2


@pytest.mark.parametrize("mode", ["i-clustered", "i-clustered+"])
def test_with_k_covering_every_key_the_error_is_zero_and_the_mass_one(mode):
    q, k, v, valid = inputs()
    config = ClusteredAttentionConfig(clusters=5, topk=64, mode=mode, backend="reference")
    for report in reports(config, q, k, v, valid):
        assert report.relative_error < EXACT_ERROR
        assert report.topk_mass == pytest.approx(1.0, abs=1e-6)


def test_topk_mass_is_the_exact_weight_on_the_cluster_keys_and_grows_with_k():
    q, k, v, valid = inputs()
    masses = []
    for topk in (2, 4, 8, 16):
        config = ClusteredAttentionConfig(clusters=5, topk=topk, backend="reference")
        masses.append([r.topk_mass for r in reports(config, q, k, v, valid)])
    # The partition does not depend on k and a larger k keeps a superset of the keys: never less mass.
    for smaller, larger in zip(masses, masses[1:], strict=False):
        assert all(0 < a <= b + 1e-6 for a, b in zip(smaller, larger, strict=True))
    assert all(m < 0.99 for m in masses[0])

    # Direct: head 0, k=4: each valid query's exact weights summed over its cluster's top-k keys.
    config = ClusteredAttentionConfig(clusters=5, topk=4, backend="reference")
    backend = dispatch.ReferenceBackend()
    assign, _, indices = inspection.cluster_steps(backend, q, k, v, valid, config, 5, 4, 0.25, 0)
    total, count = 0.0, 0
    for row in range(2):
        keep = valid[row]
        weights = torch.softmax((q[row, 0] @ k[row, 0].T) * 0.25 + torch.where(keep, 0.0, -math.inf), -1)
        for i in keep.nonzero().squeeze(-1).tolist():
            top = indices[row, 0, assign[row, 0, i]]
            total += float(weights[i, top[top >= 0]].sum())
            count += 1
    head0 = reports(config, q, k, v, valid)[0]
    assert head0.topk_mass == pytest.approx(total / count, rel=SUM_RTOL)


def test_cluster_sizes_add_up_to_the_tokens():
    q, k, v, valid = inputs(rows=1)
    config = ClusteredAttentionConfig(clusters=6, topk=4, backend="reference")
    for report in reports(config, q, k, v, valid):
        assert 1 <= report.clusters_used <= 6
        assert report.clusters_used * report.mean_cluster_size == pytest.approx(40)
        assert 1 / report.clusters_used <= report.largest_cluster_share <= 1


def test_short_rows_are_exact_as_convert_routes_them():
    q, k, v, valid = inputs()
    config = ClusteredAttentionConfig(clusters=5, topk=4, min_length=36, backend="reference")
    for report in reports(config, q, k, v, valid):  # row 1 (33 tokens) is exact, row 0 (40) clustered
        assert report.clustered_sequences == 1


def test_cluster_steps_reproduce_clustered_attention():
    q, k, v, valid = inputs()
    config = ClusteredAttentionConfig(clusters=5, topk=4, mode="i-clustered", backend="reference")
    backend = dispatch.ReferenceBackend()
    assign, counts, indices = inspection.cluster_steps(backend, q, k, v, valid, config, 5, 4, 0.25, 3)
    planes, offsets = hash_planes(0, 3, config.bits, 16, q.device)
    hashes = ref.hash_queries(q, planes, offsets)
    expected_assign, _ = ref.hamming_kmeans(hashes, valid, 5, config.iterations, config.bits)
    assert torch.equal(assign, expected_assign)
    centroids, expected_counts = ref.group_queries(q, assign, 5)
    assert torch.equal(counts, expected_counts)
    cv, ti, tm, tv = ref.centroid_attention(centroids, k, v, valid, 4, 0.25)
    assert torch.equal(indices, ti)
    out = ref.topk_refine(q, k, v, assign, cv, ti, tm, tv, 0.25)
    torch.testing.assert_close(out, clustered_attention(q, k, v, valid, config, scaling=0.25, layer=3))


def test_suggest_layers_keeps_those_within_the_budget():
    def head(layer, h, error):
        return inspection.HeadReport(layer, h, error, 0.5, 3.0, 4.0, 0.3, 1)

    report = inspection.Inspection(
        ClusteredAttentionConfig(),
        1,
        12,
        [
            head(0, 0, 0.3),
            head(0, 1, 0.1),
            head(1, 0, 0.05),
            head(1, 1, 0.12),
            head(2, 0, 0.01),
            head(2, 1, 0.02),
        ],
    )
    assert report.suggest_layers(0.1) == (1, 2)
    assert report.suggest_layers(0.01) == ()
    assert report.matrix("relative_error") == [[0.3, 0.1], [0.05, 0.12], [0.01, 0.02]]
    rows = report.per_layer()
    assert rows[0]["worst_head_error"] == 0.3 and rows[1]["relative_error"] == pytest.approx(0.085)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer, BertModel

    folder = helpers.save_model(tmp_path_factory.mktemp("inspect") / "bert", head="base", labels=None)
    return folder, BertModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


TEXTS = [
    "clustered attention groups the queries and attends once per centroid",
    "a short one",
    "the quick brown fox jumps over the lazy dog, twice, and then once more for luck",
]


def test_inspect_model_reports_every_layer_and_head_and_leaves_the_model_as_it_was(tiny, tmp_path):
    _, model, tokenizer = tiny
    encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        before = model(**encoded).last_hidden_state
    implementation = model.config._attn_implementation
    report = inspection.inspect_model(model, TEXTS, tokenizer, clusters=4, topk=3, backend="reference")
    assert model.config._attn_implementation == implementation
    with torch.inference_mode():
        torch.testing.assert_close(model(**encoded).last_hidden_state, before, rtol=0, atol=0)
    assert report.layers == [0, 1] and report.head_count == 4 and len(report.heads) == 8
    assert report.sequences == 3 and report.tokens == int(encoded["attention_mask"].sum())
    assert report.config.clusters == 4 and report.config.topk == 3
    assert all(h.relative_error > 0 and 0 < h.topk_mass < 1 for h in report.heads)
    assert all(h.clustered_sequences == 3 for h in report.heads)  # min_length 0: every row clustered
    data = json.loads(json.dumps(report.to_dict()))
    assert [row["layer"] for row in data["layers"]] == [0, 1]
    png = report.heatmap(tmp_path / "map.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_inspect_model_is_exact_with_k_covering_every_key(tiny):
    _, model, tokenizer = tiny
    report = inspection.inspect_model(model, TEXTS, tokenizer, clusters=4, topk=128, backend="reference")
    assert max(h.relative_error for h in report.heads) < EXACT_ERROR
    assert all(h.topk_mass == pytest.approx(1.0, abs=1e-6) for h in report.heads)


def test_inspect_model_refuses_bad_inputs(tiny):
    _, model, tokenizer = tiny
    with pytest.raises(ValueError, match="no inputs"):
        inspection.inspect_model(model, [], tokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        inspection.inspect_model(model, TEXTS)
    with pytest.raises(TypeError, match="ClusteredAttentionConfig"):
        inspection.inspect_model(model, TEXTS, tokenizer, config={"clusters": 4})
    with pytest.raises(ValueError, match="batch_size"):
        inspection.inspect_model(model, TEXTS, tokenizer, batch_size=0)
    with pytest.raises(TypeError):
        inspection.inspect_model(torch.nn.Linear(2, 2), TEXTS, tokenizer)


def test_cli_json_has_the_api_numbers_and_writes_the_heatmap(tiny, tmp_path):
    folder, model, tokenizer = tiny
    args = ["inspect", str(folder), "-c", "4", "--topk", "3", "--backend", "reference"]
    args += [arg for text in TEXTS for arg in ("--text", text)]
    result = runner.invoke(app, [*args, "--json", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    api = inspection.inspect_model(model, TEXTS, tokenizer, clusters=4, topk=3, backend="reference")
    assert [h["relative_error"] for h in printed["heads"]] == pytest.approx(
        [h.relative_error for h in api.heads], rel=1e-6
    )
    assert printed["suggested_layers"] == list(api.suggest_layers(0.1))
    assert (tmp_path / "out" / "inspect.png").read_bytes()[:4] == b"\x89PNG"
    written = json.loads((tmp_path / "out" / "inspect.json").read_text())
    assert written["heads"] == printed["heads"] and written["model"] == str(folder)
    assert written["files"] == ["inspect.json", "inspect.md", "inspect.png"]
    assert written["settings"]["inputs"] == "--text" and written["environment"]["packages"]["torch"]
    assert "| layer | rel. error | worst head |" in (tmp_path / "out" / "inspect.md").read_text()

    table = runner.invoke(app, [*args, "--heads"])
    assert table.exit_code == 0 and "rel. error" in table.stdout and "worst head" not in table.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "exactly one input source"),
        (["--text", "a b c", "--task", "rte"], "exactly one input source"),
        (["--text", "a b c", "--limit", "0"], "--limit must be a positive"),
        (["--file", "/nonexistent/inputs.txt"], "does not exist"),
        (["--text", "a b c", "-c", "0"], "clusters"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tiny, extra, message):
    folder, _, _ = tiny
    result = runner.invoke(app, ["inspect", str(folder), *extra])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_task_inputs_are_the_first_rows_as_text_pairs(tiny, tmp_path):
    folder, model, tokenizer = tiny
    helpers.write_rte(tmp_path / "data", helpers.RTE_ROWS)
    from bert_cluster.evaluation import load_task_texts

    pairs = load_task_texts("rte", tmp_path / "data", limit=2)
    assert pairs == [(a, b) for a, b, _ in helpers.RTE_ROWS[:2]]
    args = ["inspect", str(folder), "--task", "rte", "--data-dir", str(tmp_path / "data"), "--limit", "2"]
    result = runner.invoke(app, [*args, "-c", "4", "--backend", "reference", "--json"])
    assert result.exit_code == 0, result.output
    api = inspection.inspect_model(model, pairs, tokenizer, clusters=4, backend="reference")
    assert json.loads(result.stdout)["tokens"] == api.tokens


def test_no_module_of_the_package_shadows_the_standard_library():
    import subprocess
    import sys
    from importlib.util import find_spec
    from pathlib import Path

    import bert_cluster

    assert find_spec("bert_cluster.inspect") is None  # renamed to bert_cluster.inspection, no shim
    root = Path(bert_cluster.__file__).parent
    shadowing = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*")
        if (path.suffix == ".py" or (path / "__init__.py").is_file())
        and path.stem.split(".")[0] in sys.stdlib_module_names
    )
    assert shadowing == []
    # A script run from inside the package (its folder first on sys.path) gets the stdlib inspect.
    found = subprocess.run(
        [sys.executable, "-c", "import inspect; print(inspect.__file__)"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert not Path(found).is_relative_to(root), found


def test_inspect_checkpoint_loads_inspects_and_writes_after_checking_the_output(tiny, tmp_path, monkeypatch):
    from bert_cluster import checkpoints
    from bert_cluster.errors import UserError

    folder, model, tokenizer = tiny
    config = ClusteredAttentionConfig(clusters=4, topk=3, backend="reference")
    afile = tmp_path / "file"
    afile.write_text("x")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "load_encoder", lambda path: pytest.fail("loaded before the output check"))
        with pytest.raises(UserError, match="is a file"):
            inspection.inspect_checkpoint(folder, TEXTS, config, output=afile)
    report = inspection.inspect_checkpoint(folder, TEXTS, config, max_error=0.5, output=tmp_path / "out")
    direct = inspection.inspect_model(model, TEXTS, tokenizer, config)
    assert [h.relative_error for h in report.heads] == pytest.approx([h.relative_error for h in direct.heads])
    written = json.loads((tmp_path / "out" / "inspect.json").read_text())
    assert written["max_error"] == 0.5 and written["settings"]["max_length"] == 512
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=f"cannot load model {broken}"):
        checkpoints.load_encoder(broken)


def test_a_text_file_gives_its_first_non_empty_lines(tmp_path):
    from bert_cluster.errors import UserError

    path = tmp_path / "inputs.txt"
    path.write_text("  first line \n\n second\nthird\n", encoding="utf-8")
    assert inspection.load_text_file(path, limit=2) == ["first line", "second"]
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(UserError, match="no non-empty line"):
        inspection.load_text_file(tmp_path / "blank.txt")
    with pytest.raises(UserError, match="does not exist"):
        inspection.load_text_file(tmp_path / "gone.txt")


def test_inspect_refuses_a_used_output_folder_like_evaluate(tiny, tmp_path):
    folder, _, _ = tiny
    out = tmp_path / "out"
    args = ["inspect", str(folder), "--text", TEXTS[0], "-c", "4", "--backend", "reference", "-o", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    first = (out / "inspect.json").read_bytes()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    again = runner.invoke(app, [*args[:3], TEXTS[1], *args[4:]])
    assert again.exit_code == 2, again.output
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and f"output folder {out} is not empty (inspect.json" in lines[0], again.stderr
    assert "--overwrite" in lines[0] and (out / "inspect.json").read_bytes() == first  # nothing replaced
    replaced = runner.invoke(app, [*args[:3], TEXTS[1], *args[4:], "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert (out / "inspect.json").read_bytes() != first and (out / "notes.txt").read_text() == "mine"
