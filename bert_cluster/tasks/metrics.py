"""GLUE and SQuAD metrics that work offline, reported in points (x 100) as the GLUE/SQuAD tables do.

GLUE metrics follow the GLUE benchmark's definitions, computed with scikit-learn and scipy: accuracy,
F1 of the positive class (label 1: MRPC "equivalent", QQP "duplicate"), Matthews correlation (CoLA),
Pearson and Spearman correlation (STS-B).

SQuAD EM/F1 restate the official evaluation scripts ``evaluate-v1.1.py`` and ``evaluate-v2.0.py``
(rajpurkar.github.io/SQuAD-explorer; P. Rajpurkar et al., 2016 and 2018): an answer is normalised by
lower-casing, removing ASCII punctuation (``string.punctuation``), removing the articles a/an/the as
whole words, and collapsing whitespace; EM is exact string equality after normalisation, F1 the token
overlap F1 of the normalised answers; each prediction takes the maximum over the gold answers. For
unanswerable v2 questions the only gold answer is the empty string, and F1 with an empty side is 1 if
both are empty, else 0. The v2 script also reports the HasAns / NoAns subsets.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

import numpy as np

GLUE_METRICS = ("accuracy", "f1", "matthews_correlation", "pearson", "spearmanr")
#: What ``squad_scores`` returns (the HasAns / NoAns subsets with ``version_2`` only).
SQUAD_METRICS = ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1")

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def glue_metric(name: str, predictions: Sequence[float], references: Sequence[float]) -> float:
    """One GLUE metric in points; ``predictions`` are class indices, or scores for pearson/spearmanr."""
    from scipy import stats
    from sklearn import metrics

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if len(references) == 0:
        raise ValueError("no examples to score")
    if name == "accuracy":
        return 100.0 * float(metrics.accuracy_score(references, predictions))
    if name == "f1":
        return 100.0 * float(metrics.f1_score(references, predictions, pos_label=1, zero_division=0))
    if name == "matthews_correlation":
        return 100.0 * float(metrics.matthews_corrcoef(references, predictions))
    if name == "pearson":
        return 100.0 * float(stats.pearsonr(np.asarray(predictions, float), np.asarray(references, float))[0])
    if name == "spearmanr":
        return 100.0 * float(stats.spearmanr(predictions, references)[0])
    raise ValueError(f"unknown GLUE metric {name!r}; known: {', '.join(GLUE_METRICS)}")


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation: lower case, drop punctuation and articles, fix whitespace."""
    text = text.lower()
    text = "".join(char for char in text if char not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str, version_2: bool = True) -> float:
    """Token-overlap F1 of the normalised answers.

    The v2.0 script scores an empty side 1 if both are empty, else 0; the v1.1 script has no such case
    (no overlap: 0).
    """
    predicted = normalize_answer(prediction).split()
    golden = normalize_answer(gold).split()
    if version_2 and (not predicted or not golden):
        return float(predicted == golden)
    common = collections.Counter(predicted) & collections.Counter(golden)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(predicted)
    recall = same / len(golden)
    return 2 * precision * recall / (precision + recall)


def squad_scores(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]], version_2: bool = False
) -> dict[str, float]:
    """EM and F1 in points over ``references`` (question id -> gold answer texts; empty: unanswerable).

    A question without a prediction scores 0, as in the official scripts. With ``version_2`` the
    HasAns_* and NoAns_* subsets are added (only those with at least one question).
    """
    if not references:
        raise ValueError("no questions to score")
    exact: dict[str, float] = {}
    f1: dict[str, float] = {}
    for qid, golds in references.items():
        if version_2:  # v2.0 drops golds that normalise to nothing; none left means unanswerable
            golds = [gold for gold in golds if normalize_answer(gold)] or [""]
        elif not golds:
            raise ValueError(f"question {qid!r} has no gold answer (a SQuAD v1.1 question always has one)")
        prediction = predictions.get(qid)
        if prediction is None:
            exact[qid] = f1[qid] = 0.0
            continue
        exact[qid] = max(exact_match(prediction, gold) for gold in golds)
        f1[qid] = max(token_f1(prediction, gold, version_2) for gold in golds)

    def mean(values: list[float]) -> float:
        return 100.0 * sum(values) / len(values)

    scores = {"exact": mean(list(exact.values())), "f1": mean(list(f1.values()))}
    if version_2:
        has = [qid for qid, golds in references.items() if golds]
        no = [qid for qid, golds in references.items() if not golds]
        for prefix, ids in (("HasAns", has), ("NoAns", no)):
            if ids:
                scores[f"{prefix}_exact"] = mean([exact[qid] for qid in ids])
                scores[f"{prefix}_f1"] = mean([f1[qid] for qid in ids])
    return scores
