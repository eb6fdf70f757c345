from __future__ import annotations

import helpers
import pytest

from bert_cluster.errors import UserError
from bert_cluster.tasks.config import get_tasks
from bert_cluster.tasks.kinds import ScoreSettings
from bert_cluster.tasks.kinds.classification import CLASSIFICATION, label_mapping

RTE = get_tasks("rte")[0]
STSB = get_tasks("stsb")[0]


def no_progress(done, total, tokens=0, tokens_total=0):
    assert 0 <= done <= total and 0 <= tokens <= tokens_total


def test_label_mapping():
    assert label_mapping({0: "entailment", 1: "not_entailment"}, 2, RTE) is None
    assert label_mapping({0: "not_entailment", 1: "entailment"}, 2, RTE) == [1, 0]
    assert label_mapping({0: "NOT-ENTAILMENT", 1: "Entailment"}, 2, RTE) == [1, 0]
    assert label_mapping({0: "LABEL_0", 1: "LABEL_1"}, 2, RTE) is None  # generic: trust the dataset order
    assert label_mapping({0: "LABEL_0"}, 1, STSB) is None
    with pytest.raises(UserError, match="do not match"):
        label_mapping({0: "negative", 1: "positive"}, 2, RTE)
    with pytest.raises(UserError, match="has 2 labels.*head has 3"):
        label_mapping({0: "a", 1: "b", 2: "c"}, 3, RTE)
    with pytest.raises(UserError, match="regression"):
        label_mapping({0: "a", 1: "b"}, 2, STSB)


def test_swapped_label_order_gives_the_same_accuracy(tiny_cls, tiny_rte, tmp_path):
    loaded = CLASSIFICATION.load_model(tiny_cls, RTE, "cpu")
    examples = CLASSIFICATION.load_examples(RTE, tiny_rte, None)
    # Gold labels := the tiny model's own predictions, so its accuracy is 100 and an inversion would give 0.
    import torch

    with torch.inference_mode():
        for item in examples.items:
            inputs = loaded.tokenizer(*item["texts"], return_tensors="pt")
            item["label"] = int(loaded.model(**inputs).logits.argmax())
    settings = ScoreSettings(batch_size=3)
    assert CLASSIFICATION.score(loaded, RTE, examples, settings, no_progress) == {"accuracy": 100.0}
    swapped = CLASSIFICATION.load_model(helpers.swap_labels(tiny_cls, tmp_path / "swapped"), RTE, "cpu")
    assert swapped.extra["label_mapping"] == [1, 0]
    assert CLASSIFICATION.score(swapped, RTE, examples, settings, no_progress) == {"accuracy": 100.0}
    swapped.extra["label_mapping"] = None  # what a runner that ignored the names would report
    assert CLASSIFICATION.score(swapped, RTE, examples, settings, no_progress) == {"accuracy": 0.0}


def test_padding_and_batching_do_not_change_predictions(tiny_cls, tiny_rte):
    loaded = CLASSIFICATION.load_model(tiny_cls, RTE, "cpu")
    examples = CLASSIFICATION.load_examples(RTE, tiny_rte, None)
    one = CLASSIFICATION.score(loaded, RTE, examples, ScoreSettings(batch_size=1), no_progress)
    many = CLASSIFICATION.score(loaded, RTE, examples, ScoreSettings(batch_size=8), no_progress)
    assert one == many


@pytest.mark.parametrize(
    ("head", "labels", "message"),
    [
        ("qa", None, "no trained sequence-classification head"),
        ("base", None, "no trained sequence-classification head"),
        ("cls", ("entailment", "neutral", "contradiction"), "head has 3"),
        ("cls", ("positive", "negative"), "do not match"),
    ],
)
def test_heads_that_do_not_fit_are_refused(tmp_path, head, labels, message):
    folder = helpers.save_model(tmp_path / "m", head=head, labels=labels)
    with pytest.raises(UserError, match=message):
        CLASSIFICATION.load_model(folder, RTE, "cpu")


def test_unreadable_model_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        CLASSIFICATION.load_model(tmp_path / "absent", RTE, "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        CLASSIFICATION.load_model(tmp_path / "empty", RTE, "cpu")


# Unmodified scores of ../shared/models/README.md (measured there with plain transformers, SDPA, each input
# truncated at 512 tokens, no padding); our runner pads per batch, which moves no prediction here.
README_SCORES = {
    "rte": {"accuracy": 55.2},
    "mrpc": {"accuracy": 78.9, "f1": 85.3},
    "stsb": {"pearson": 86.64, "spearmanr": 86.46},
}


@pytest.mark.data
@pytest.mark.slow(reason="a real checkpoint on its whole GLUE dev set, unmodified and clustered")
@pytest.mark.parametrize("name", sorted(README_SCORES))
def test_real_checkpoints_reproduce_the_readme_scores(shared_dir, built_models, name):
    spec = get_tasks(name)[0]
    loaded = CLASSIFICATION.load_model(built_models / f"minilm-l6-{name}", spec, "cpu")
    examples = CLASSIFICATION.load_examples(spec, shared_dir / "data", None)
    scores = CLASSIFICATION.score(loaded, spec, examples, ScoreSettings(), no_progress)
    for metric, expected in README_SCORES[name].items():
        digits = len(str(expected).split(".")[1])
        assert round(scores[metric], digits) == expected, (metric, scores[metric])
