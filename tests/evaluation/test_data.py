from __future__ import annotations

import pandas as pd
import pytest

from bert_cluster.evaluation.classification import CLASSIFICATION
from bert_cluster.evaluation.data import load_rows
from bert_cluster.evaluation.errors import UserError
from bert_cluster.evaluation.squad import SQUAD
from bert_cluster.evaluation.tasks import get_tasks


def task(name):
    return get_tasks(name)[0]


def test_glue_tsv_quirks(tmp_path):
    # CoLA: no header; MRPC: byte-order mark and its own column names; quotes are text, not quoting.
    (tmp_path / "CoLA").mkdir()
    (tmp_path / "CoLA" / "dev.tsv").write_text('gj04\t1\t\tHe said "hi.\ncj99\t0\t*\tMore the.\n')
    (tmp_path / "MRPC").mkdir()
    (tmp_path / "MRPC" / "dev.tsv").write_bytes(
        '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\t" A quote .\tB .\n'.encode()
    )
    cola = CLASSIFICATION.load_examples(task("cola"), tmp_path, None)
    assert [item["texts"] for item in cola.items] == [('He said "hi.',), ("More the.",)]
    assert [item["label"] for item in cola.items] == [1, 0]
    mrpc = CLASSIFICATION.load_examples(task("mrpc"), tmp_path, None)
    assert mrpc.items == [{"texts": ('" A quote .', "B ."), "label": 1}]
    assert mrpc.source.endswith("MRPC/dev.tsv")


def test_parquet_layout_one_folder_down_with_shard_names(tmp_path):
    folder = tmp_path / "glue" / "mnli"
    folder.mkdir(parents=True)
    frame = pd.DataFrame(
        {"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"], "label": [2, 0], "idx": [0, 1]}
    )
    frame.to_parquet(folder / "validation_matched-00000-of-00001.parquet")
    examples = CLASSIFICATION.load_examples(task("mnli"), tmp_path, 1)
    assert examples.count == 1 and examples.items[0] == {"texts": ("p1", "h1"), "label": 2}
    assert examples.source.endswith("glue/mnli/validation_matched-00000-of-00001.parquet")
    with pytest.raises(UserError, match="mnli_mismatched.*looked at: .*validation_mismatched"):
        CLASSIFICATION.load_examples(task("mnli_mismatched"), tmp_path, None)


def test_string_labels_map_by_name_and_unknown_labels_are_refused(tmp_path):
    (tmp_path / "RTE").mkdir()
    path = tmp_path / "RTE" / "dev.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tnot_entailment\n1\tc\td\tentailment\n")
    assert [i["label"] for i in CLASSIFICATION.load_examples(task("rte"), tmp_path, None).items] == [1, 0]
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(UserError, match="'maybe' is not one of"):
        CLASSIFICATION.load_examples(task("rte"), tmp_path, None)


def test_missing_files_name_every_path_looked_at(tmp_path):
    with pytest.raises(UserError) as caught:
        load_rows(task("rte"), tmp_path)
    message = str(caught.value)
    for expected in ("RTE/dev.tsv", "rte/validation.parquet", "*/RTE/dev.tsv"):
        assert str(tmp_path / expected) in message
    with pytest.raises(UserError, match="does not exist"):
        load_rows(task("rte"), tmp_path / "nowhere")


def test_squad_json(tmp_path):
    document = {
        "version": "v2.0",
        "data": [
            {
                "title": "T",
                "paragraphs": [
                    {
                        "context": "Alpha beta.",
                        "qas": [
                            {
                                "id": "a",
                                "question": "What?",
                                "answers": [{"text": "beta", "answer_start": 6}],
                            },
                            {
                                "id": "b",
                                "question": "Who?",
                                "answers": [],
                                "plausible_answers": [{"text": "Alpha", "answer_start": 0}],
                                "is_impossible": True,
                            },
                        ],
                    }
                ],
            }
        ],
    }
    import json

    (tmp_path / "dev-v2.0.json").write_text(json.dumps(document))
    examples = SQUAD.load_examples(task("squad_v2"), tmp_path, None)
    assert [item["answers"] for item in examples.items] == [["beta"], []]


EXPECTED_COUNTS = {
    "cola": 1043,
    "sst2": 872,
    "mrpc": 408,
    "stsb": 1500,
    "qqp": 40430,
    "mnli": 9815,
    "mnli_mismatched": 9832,
    "qnli": 5463,
    "rte": 277,
    "wnli": 71,
    "squad": 10570,
    "squad_v2": 11873,
}


@pytest.mark.data
@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_real_dev_sets_read_completely(shared_dir, name):
    spec = task(name)
    kind = SQUAD if spec.kind == "squad" else CLASSIFICATION
    examples = kind.load_examples(spec, shared_dir / "data", None)
    assert examples.count == EXPECTED_COUNTS[name]
    assert str(shared_dir) in examples.source or "shared" in examples.source
    if spec.label_names:
        assert {item["label"] for item in examples.items} == set(range(len(spec.label_names)))
    if name == "stsb":
        assert (
            min(i["label"] for i in examples.items) == 0.0 and max(i["label"] for i in examples.items) == 5.0
        )


def test_the_hub_is_asked_only_without_data_folders(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return [{"sentence1": "a", "sentence2": "b", "label": 1, "idx": 0}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.delenv("BERT_CLUSTER_DATA_DIR", raising=False)
    rows = load_rows(task("rte"), None)
    assert calls == [("nyu-mll/glue", "rte", "validation")]
    assert rows.source == "hub:nyu-mll/glue/rte:validation" and rows.rows[0]["label"] == 1

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub\nmore details")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(
        UserError, match=r"hub dataset nyu-mll/glue could not be loaded \(Couldn't reach the hub\)"
    ):
        load_rows(task("rte"), None)


def test_the_api_is_reachable_lazily_from_the_package():
    import bert_cluster
    from bert_cluster import evaluation

    assert bert_cluster.evaluate is evaluation.evaluate is evaluation.run
