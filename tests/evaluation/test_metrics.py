"""Metrics on values worked out by hand from the official definitions."""

from __future__ import annotations

import math

import pytest

from bert_cluster.tasks.metrics import exact_match, glue_metric, normalize_answer, squad_scores, token_f1


def test_accuracy_and_positive_class_f1():
    predictions, references = [1, 0, 1, 1, 0], [1, 0, 0, 1, 1]
    assert glue_metric("accuracy", predictions, references) == pytest.approx(60.0)
    # tp=2, fp=1, fn=1: precision 2/3, recall 2/3
    assert glue_metric("f1", predictions, references) == pytest.approx(100 * 2 / 3)


def test_matthews_correlation_by_hand():
    predictions, references = [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]
    tp, tn, fp, fn = 2, 2, 1, 1
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert glue_metric("matthews_correlation", predictions, references) == pytest.approx(100 * mcc)


def test_pearson_is_linear_and_spearman_is_rank_correlation():
    gold = [0.0, 1.0, 2.0, 3.0, 4.0]
    cubed = [value**3 for value in gold]
    assert glue_metric("spearmanr", cubed, gold) == pytest.approx(100.0)
    assert glue_metric("pearson", [2 * g + 1 for g in gold], gold) == pytest.approx(100.0)
    assert glue_metric("pearson", cubed, gold) < 99.0


def test_glue_metric_refuses_mismatched_lengths_and_unknown_names():
    with pytest.raises(ValueError, match="2 predictions for 3"):
        glue_metric("accuracy", [1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="unknown GLUE metric"):
        glue_metric("bleu", [1], [1])


def test_squad_normalisation_follows_the_official_script():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0


def test_squad_f1_by_hand():
    # "cat sat on mat" vs "cat sat": 2 common tokens, precision 2/4, recall 2/2
    assert token_f1("the cat sat on the mat", "a cat sat") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("", "") == 1.0  # v2.0: both empty
    assert token_f1("", "", version_2=False) == 0.0  # v1.1 has no such case: no overlap


def test_squad_scores_take_the_best_gold_and_split_v2_subsets():
    references = {"q1": ["Denver Broncos", "the Broncos"], "q2": ["1990"], "q3": []}
    predictions = {"q1": "Broncos", "q2": "in 1990", "q3": ""}
    scores = squad_scores(predictions, references, version_2=True)
    f1_q1, f1_q2 = 1.0, 2 * 0.5 * 1.0 / 1.5
    assert scores["exact"] == pytest.approx(100 * 2 / 3)  # q1 (vs "the Broncos") and q3
    assert scores["f1"] == pytest.approx(100 * (f1_q1 + f1_q2 + 1.0) / 3)
    assert scores["HasAns_exact"] == pytest.approx(50.0)
    assert scores["NoAns_exact"] == pytest.approx(100.0)
    wrong = squad_scores({"q3": "something"}, {"q3": []}, version_2=True)
    assert wrong["exact"] == wrong["f1"] == wrong["NoAns_f1"] == 0.0


def test_squad_v1_counts_a_missing_prediction_as_zero():
    scores = squad_scores({"a": "x"}, {"a": ["x"], "b": ["y"]})
    assert scores == {"exact": 50.0, "f1": 50.0}
