from __future__ import annotations

import pytest

from bert_cluster.errors import UserError
from bert_cluster.tasks.config import (
    get_tasks,
    load_catalog,
    load_task_file,
    load_tasks,
    parse_task,
    task_files,
)
from bert_cluster.tasks.kinds import get_kind

GLUE = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "mnli_mismatched", "qnli", "rte", "wnli")


def test_every_task_file_loads_and_suits_its_kind():
    files = task_files()
    assert len(files) >= 12
    assert load_catalog().problems == []
    for path in files:
        task = load_task_file(path)
        get_kind(task)  # registered; fields, options and metric names accepted
        assert task.data.files or task.data.hub, path


def test_glue_and_squad_tasks_are_defined_with_their_official_metrics():
    tasks = load_tasks()
    expected = {
        "cola": ["matthews_correlation"],
        "sst2": ["accuracy"],
        "mrpc": ["accuracy", "f1"],
        "qqp": ["accuracy", "f1"],
        "stsb": ["pearson", "spearmanr"],
        "mnli": ["accuracy"],
        "mnli_mismatched": ["accuracy"],
        "qnli": ["accuracy"],
        "rte": ["accuracy"],
        "wnli": ["accuracy"],
        "squad": ["exact", "f1"],
        "squad_v2": ["exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1"],
    }
    for name, metrics in expected.items():
        assert list(tasks[name].metric_names) == metrics, name
    assert tasks["stsb"].label_names is None
    assert tasks["squad"].max_length == 384 and tasks["squad"].options["doc_stride"] == 128


def test_include_overrides_only_what_the_variant_changes():
    tasks = load_tasks()
    matched, mismatched = tasks["mnli"], tasks["mnli_mismatched"]
    assert mismatched.label_names == matched.label_names == ("entailment", "neutral", "contradiction")
    assert mismatched.text_fields == matched.text_fields
    assert mismatched.data.hub.split == "validation_mismatched" != matched.data.hub.split
    assert all("mismatched" in spec.path for spec in mismatched.data.files)
    assert tasks["squad_v2"].options["postprocessor"] == "squad_v2"
    assert tasks["squad_v2"].options["n_best"] == tasks["squad"].options["n_best"] == 20


def test_get_tasks_keeps_order_and_rejects_unknown_names():
    assert [t.name for t in get_tasks("rte, mrpc")] == ["rte", "mrpc"]
    with pytest.raises(UserError, match=r"unknown task\(s\) nope.*known: .*rte"):
        get_tasks(["rte", "nope"])


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"name": "x", "kind": "classification", "version": 1, "colour": 1}, "unknown key"),
        ({"name": "x", "kind": "classification"}, "version"),
        ({"name": "x", "kind": "classification", "version": 1, "max_length": 0}, "max_length"),
        (
            {
                "name": "x",
                "kind": "classification",
                "version": 1,
                "data": {"files": [{"path": "a", "format": "xls"}]},
            },
            "format",
        ),
        ({"name": "x", "kind": "classification", "version": 1, "label_names": ["a", "a"]}, "distinct"),
    ],
)
def test_parse_task_says_what_is_wrong(raw, message):
    with pytest.raises(UserError, match=message):
        parse_task(raw)


def test_options_are_free_form_for_other_kinds(tmp_path):
    (tmp_path / "base.yaml").write_text("name: a\nkind: retrieval\nversion: 2\noptions: {k: [1, 5], n: 3}\n")
    (tmp_path / "variant.yaml").write_text("include: base.yaml\nname: b\noptions: {n: 4}\n")
    task = load_task_file(tmp_path / "variant.yaml")
    assert (task.name, task.version, dict(task.options)) == ("b", 2, {"k": [1, 5], "n": 4})
    (tmp_path / "loop.yaml").write_text("include: loop.yaml\nname: c\n")
    with pytest.raises(UserError, match="include cycle"):
        load_task_file(tmp_path / "loop.yaml")
