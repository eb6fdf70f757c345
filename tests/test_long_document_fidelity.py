"""benchmarks.long_document_fidelity (issue 40, item 3): settings parsed or refused with exit 2, and a run on
a small random sentence-transformer that tells an approximation from exact attention."""

from __future__ import annotations

import json

import pytest
from helpers import save_sentence_transformer

from benchmarks import long_document_fidelity


def _script():
    return long_document_fidelity


def test_settings_parse_and_bad_ones_exit_2_with_one_line(tmp_path, capsys):
    script = _script()
    assert script.parse_setting("defaults") == {}
    assert script.parse_setting("cluster_growth=0.75,topk=64") == {"cluster_growth": 0.75, "topk": 64}
    assert script.parse_setting("mode=i-clustered") == {"mode": "i-clustered"}
    output = tmp_path / "out.json"
    for setting, message in [
        ("bits=3", "names clusters, topk, mode, cluster_growth, topk_growth"),
        ("topk=many", "topk takes a number, got 'many'"),
        ("cluster_growth=2", "cluster_growth must be a number in 0..1"),
    ]:
        with pytest.raises(SystemExit) as stop:
            script.main(["--minilm-16k", "unused", "--settings", setting, "--output", str(output)])
        error = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and message in error[-1]
    assert not output.exists()


@pytest.mark.slow(reason="the proxy scored on both splits at several settings")
def test_a_run_scores_both_splits_and_tells_an_approximation_from_exact(tmp_path, monkeypatch):
    """At 64 tokens convert's min_length "auto" leaves every row exact: the defaults score as exact does.
    Forced onto every row at C = 2, the articles move and the question check says so."""
    import bert_cluster

    script = _script()
    model = save_sentence_transformer(tmp_path / "st", max_seq_length=64)
    output = tmp_path / "out" / "fidelity.json"
    arguments = ["--minilm-16k", str(model), "--length", "64", "--output", str(output)]
    assert script.main([*arguments, "--settings", "defaults"]) == 0
    exact, defaults = json.loads(output.read_text())["rows"]
    assert exact["setting"] == "exact" and (defaults["clusters"], defaults["topk"]) == (25, 32)
    for split in ("training", "held_out"):
        assert defaults[split]["R@1"] == exact[split]["R@1"] and 0 < exact[split]["R@1"] <= 100
        assert defaults[split]["cosine_to_exact"] == pytest.approx(1.0) and defaults[split]["questions_exact"]

    convert = bert_cluster.convert
    monkeypatch.setattr(bert_cluster, "convert", lambda m, **kw: convert(m, **{**kw, "min_length": 0}))
    assert script.main([*arguments, "--settings", "clusters=2,topk=2"]) == 0
    forced = json.loads(output.read_text())["rows"][1]
    assert (forced["clusters"], forced["topk"]) == (2, 2) and forced["forward_backward_seconds"] > 0
    assert forced["held_out"]["cosine_to_exact"] < 0.9999 and not forced["held_out"]["questions_exact"]
