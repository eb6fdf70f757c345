"""Every loader path on small files: each goes through datasets.load_dataset, as the hub path does."""

from __future__ import annotations

import gzip
import json

import pytest

from bert_cluster.errors import UserError
from bert_cluster.tasks import data
from bert_cluster.tasks.config import get_tasks, parse_task
from bert_cluster.tasks.data import load_rows
from bert_cluster.tasks.kinds.classification import CLASSIFICATION
from bert_cluster.tasks.kinds.squad import SQUAD


def task(name):
    return get_tasks(name)[0]


@pytest.fixture
def calls(monkeypatch):
    """Every datasets.load_dataset call (the real one still runs)."""
    import datasets

    seen = []
    real = datasets.load_dataset

    def recording(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recording)
    return seen


def test_glue_tsv_quirks(tmp_path, calls):
    # CoLA: no header; MRPC: byte-order mark and its own column names; quotes are text, not quoting;
    # "NA" is a sentence, not a missing value.
    (tmp_path / "CoLA").mkdir()
    (tmp_path / "CoLA" / "dev.tsv").write_text('gj04\t1\t\tHe said "hi.\ncj99\t0\t*\tNA\n')
    (tmp_path / "MRPC").mkdir()
    (tmp_path / "MRPC" / "dev.tsv").write_bytes(
        '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\t" A quote .\tB .\n'.encode()
    )
    cola = CLASSIFICATION.load_examples(task("cola"), [tmp_path], None)
    assert [item["texts"] for item in cola.items] == [('He said "hi.',), ("NA",)]
    assert [item["label"] for item in cola.items] == [1, 0]
    mrpc = CLASSIFICATION.load_examples(task("mrpc"), [tmp_path], None)
    assert mrpc.items == [{"texts": ('" A quote .', "B ."), "label": 1}]
    assert mrpc.source.endswith("MRPC/dev.tsv")
    assert [args[0] for args, _ in calls] == ["csv", "csv"]
    assert (
        calls[1][1]["quoting"] == 3 and calls[1][1]["encoding"] == "utf-8-sig" and calls[1][1]["sep"] == "\t"
    )


def test_csv_with_quoting_and_jsonl(tmp_path, calls):
    spec = {
        "name": "x",
        "kind": "classification",
        "version": 1,
        "text_fields": ["text"],
        "label_field": "label",
        "label_names": ["no", "yes"],
        "metrics": ["accuracy"],
    }
    csv_task = parse_task({**spec, "data": {"files": [{"path": "x.csv", "format": "csv", "quoting": True}]}})
    (tmp_path / "x.csv").write_text('text,label\n"a, quoted, text",yes\nplain,0\n')
    examples = CLASSIFICATION.load_examples(csv_task, [tmp_path], None)
    assert examples.items == [{"texts": ("a, quoted, text",), "label": 1}, {"texts": ("plain",), "label": 0}]
    jsonl_task = parse_task({**spec, "data": {"files": [{"path": "x.jsonl", "format": "jsonl"}]}})
    (tmp_path / "x.jsonl").write_text('{"text": "one", "label": 1}\n{"text": "two", "label": "no"}\n')
    examples = CLASSIFICATION.load_examples(jsonl_task, [tmp_path], 1)
    assert examples.items == [{"texts": ("one",), "label": 1}] and examples.count == 1
    json_task = parse_task({**spec, "data": {"files": [{"path": "x.json", "format": "json"}]}})
    (tmp_path / "x.json").write_text('[{"text": "three", "label": "yes"}]')
    assert CLASSIFICATION.load_examples(json_task, [tmp_path], None).items == [
        {"texts": ("three",), "label": 1}
    ]
    assert [args[0] for args, _ in calls] == ["csv", "json", "json"]


def test_parquet_layout_one_folder_down_with_shard_names(tmp_path, calls):
    import datasets

    folder = tmp_path / "glue" / "mnli"
    folder.mkdir(parents=True)
    rows = {"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"], "label": [2, 0], "idx": [0, 1]}
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "validation_matched-00000-of-00001.parquet"))
    examples = CLASSIFICATION.load_examples(task("mnli"), [tmp_path], 1)
    assert examples.count == 1 and examples.items[0] == {"texts": ("p1", "h1"), "label": 2}
    assert examples.source.endswith("glue/mnli/validation_matched-00000-of-00001.parquet")
    assert calls[-1][0][0] == "parquet"
    with pytest.raises(UserError, match="mnli_mismatched.*looked at: .*validation_mismatched"):
        CLASSIFICATION.load_examples(task("mnli_mismatched"), [tmp_path], None)


def test_string_labels_map_by_name_and_unknown_labels_are_refused(tmp_path):
    (tmp_path / "RTE").mkdir()
    path = tmp_path / "RTE" / "dev.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tnot_entailment\n1\tc\td\tentailment\n")
    assert [i["label"] for i in CLASSIFICATION.load_examples(task("rte"), [tmp_path], None).items] == [1, 0]
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(UserError, match="'maybe' is not one of"):
        CLASSIFICATION.load_examples(task("rte"), [tmp_path], None)


def test_missing_columns_and_malformed_files_say_which_file(tmp_path):
    (tmp_path / "RTE").mkdir()
    path = tmp_path / "RTE" / "dev.tsv"
    path.write_text("index\tpremise\thypothesis\tlabel\n0\ta\tb\tentailment\n")
    with pytest.raises(
        UserError, match=r"RTE/dev.tsv: column 'sentence1' \(for 'sentence1'\) is not in the file's columns"
    ):
        load_rows(task("rte"), [tmp_path])
    (tmp_path / "dev-v1.1.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read .*dev-v1.1.json as squad-json"):
        load_rows(task("squad"), [tmp_path])


def test_missing_files_name_every_path_looked_at(tmp_path):
    with pytest.raises(UserError) as caught:
        load_rows(task("rte"), tmp_path)
    message = str(caught.value)
    for expected in ("RTE/dev.tsv", "rte/validation.parquet", "*/RTE/dev.tsv"):
        assert str(tmp_path / expected) in message
    with pytest.raises(UserError, match="does not exist"):
        load_rows(task("rte"), tmp_path / "nowhere")


SQUAD_V2 = {
    "version": "v2.0",
    "data": [
        {
            "title": "T",
            "paragraphs": [
                {
                    "context": "Alpha beta.",
                    "qas": [
                        {"id": "a", "question": "What?", "answers": [{"text": "beta", "answer_start": 6}]},
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


def test_squad_json(tmp_path, calls):
    (tmp_path / "dev-v2.0.json").write_text(json.dumps(SQUAD_V2))
    examples = SQUAD.load_examples(task("squad_v2"), [tmp_path], None)
    assert [item["answers"] for item in examples.items] == [["beta"], []]
    assert calls[0][0][0] == "json" and calls[0][1]["field"] == "data"


def test_a_squad_question_without_id_names_the_file_and_the_question(tmp_path):
    document = json.loads(json.dumps(SQUAD_V2))
    del document["data"][0]["paragraphs"][0]["qas"][1]["id"]
    (tmp_path / "dev-v2.0.json").write_text(json.dumps(document))
    with pytest.raises(UserError, match=r"dev-v2.0.json: the question 'Who\?' \(article 'T'\) has no id"):
        SQUAD.load_examples(task("squad_v2"), [tmp_path], None)


def test_the_packaged_retrieval_file(tmp_path, calls, monkeypatch):
    document = {
        "paragraphs": [{"id": "T/0", "context": "Alpha."}, {"id": "T/1", "context": "Beta."}],
        "questions": [{"id": "q1", "question": "A?", "paragraph": "T/1"}],
    }
    with gzip.open(tmp_path / "squad_v1_dev_retrieval.json.gz", "wt", encoding="utf-8") as handle:
        json.dump(document, handle)
    monkeypatch.setattr(data, "PACKAGE_DATA", tmp_path)
    rows = load_rows(task("squad-retrieval"), None)
    assert rows.rows == [
        {"id": "q1", "title": "T", "passage_id": "T/1", "context": "Beta.", "question": "A?"}
    ]
    assert [kwargs["field"] for _, kwargs in calls] == ["paragraphs", "questions"]


@pytest.mark.data
@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("cola", 1043),
        ("sst2", 872),
        ("mrpc", 408),
        ("stsb", 1500),
        ("qqp", 40430),
        ("mnli", 9815),
        ("mnli_mismatched", 9832),
        ("qnli", 5463),
        ("rte", 277),
        ("wnli", 71),
        ("squad", 10570),
        ("squad_v2", 11873),
    ],
)
def test_real_dev_sets_read_completely(shared_dir, name, count):
    spec = task(name)
    kind = SQUAD if spec.kind == "squad" else CLASSIFICATION
    examples = kind.load_examples(spec, [shared_dir / "data"], None)
    assert examples.count == count
    assert str(shared_dir) in examples.source or "shared" in examples.source
    if spec.label_names:
        assert {item["label"] for item in examples.items} == set(range(len(spec.label_names)))
    if name == "stsb":
        labels = [item["label"] for item in examples.items]
        assert min(labels) == 0.0 and max(labels) == 5.0


def test_the_hub_is_asked_only_without_data_folders(monkeypatch):
    import datasets

    calls = []

    class FakeDataset(list):
        def to_list(self):
            return list(self)

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return FakeDataset([{"sentence1": "a", "sentence2": "b", "label": 1, "idx": 0}])

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
