"""The tuner: its search (against a scripted session whose score change is known), then tiny real models."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import bert_cluster
from bert_cluster.cli import app
from bert_cluster.config import MODES, ClusteredAttentionConfig
from bert_cluster.evaluation import TaskSession, TuneResult, UserError, get_tasks, tune
from bert_cluster.evaluation import tuner as tuner_module
from bert_cluster.evaluation.report import RunResult
from bert_cluster.evaluation.tuner import attention_cost, load_config, uses_topk
from bert_cluster.parallel import Timing

LAYERS = list(range(6))
LENGTH = 1280.0  # the scripted slice's mean row length (tokens)


def penalty(config: ClusteredAttentionConfig) -> float:
    """The scripted score drop (points): smaller with more clusters, more keys and fewer patched layers."""
    patched = len(config.layers) if config.layers is not None else 6
    topk = math.sqrt(32 / config.topk) if uses_topk(config.mode) else 2.0
    return 40.0 / config.clusters * topk * patched / 6


class ScriptedSession:
    """Stands in for ``TaskSession``: scores from ``penalty``, time from the cost model, calls counted."""

    instances: list[ScriptedSession] = []
    default_count = 400  # examples without a limit

    def __init__(self, task, model, *, limit=None, workers=None, reporter=None, **options) -> None:
        self.limit = limit
        self.examples = SimpleNamespace(count=limit or self.default_count)
        self.loaded = SimpleNamespace(target=None)
        self.workers = SimpleNamespace(combined_timing=lambda: Timing(seconds=1.0, items=10, tokens=12800))
        self.settings = SimpleNamespace(device="cpu")
        self.unmodified = None
        self.calls: list[ClusteredAttentionConfig | None] = []
        ScriptedSession.instances.append(self)

    def score(self, config):
        self.calls.append(config)
        drop = 0.0 if config is None else penalty(config)
        seconds = (
            1.0 if config is None else attention_cost(config, LAYERS, LENGTH, uses_topk(config.mode)) + 0.2
        )
        run = RunResult(
            clusters=None if config is None else config.clusters,
            seed=None if config is None else config.seed,
            scores={"accuracy": 80.0 - drop, "f1": 85.0 - drop / 2},
            wall_time_s=seconds,
            examples_per_s=1.0,
            speedup=1.0 if self.unmodified is None else 1.0 / seconds,
            mode=None if config is None else config.mode,
        )
        if config is None:
            self.unmodified = run
        return run


@pytest.fixture
def scripted(monkeypatch):
    """``tune`` on the scripted session (task mrpc: metrics accuracy and f1); returns the sessions made."""
    from bert_cluster.evaluation import runner

    ScriptedSession.instances = []
    monkeypatch.setattr(runner, "TaskSession", ScriptedSession)
    monkeypatch.setattr(tuner_module, "_layer_numbers", lambda target: LAYERS)
    return ScriptedSession.instances


def scripted_tune(tmp_path, **kwargs):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    kwargs.setdefault("screen", None)
    return tune(folder, "mrpc", **kwargs)


def tried(result, stage="grid", mode="i-clustered"):
    return [
        (c.config.clusters, c.config.topk)
        for c in result.candidates
        if c.stage == stage and c.config.mode == mode
    ]


def test_the_grid_search_stops_at_the_first_failing_cluster_count(scripted, tmp_path):
    # i-clustered drops 40/C * sqrt(32/k): at budget 0.5 only C=100 with k >= 32... is within budget:
    # k=16: C=100 (0.57) fails at once; k=32: C=100 (0.40) passes, C=50 (0.80) fails: stop;
    # k=64: only C below 100 is worth trying: C=50 (0.57) fails: stop.
    result = scripted_tune(tmp_path, budget=0.5, modes="i-clustered", layers="all")
    assert tried(result) == [(100, 16), (100, 32), (50, 32), (50, 64)]
    (session,) = scripted
    assert len(session.calls) == 1 + 4  # the unmodified pass once, reused for every candidate
    assert session.calls[0] is None and session.calls.count(None) == 1
    assert result.chosen.config.clusters == 100 and result.chosen.config.topk == 32
    assert all(change >= -0.5 for change in result.chosen.changes.values())
    assert result.chosen.changes["accuracy"] == pytest.approx(-penalty(result.chosen.config))
    assert result.chosen.speedup == pytest.approx(
        1 / (attention_cost(result.chosen.config, LAYERS, LENGTH, True) + 0.2)
    )


def test_a_generous_budget_needs_one_k_and_picks_the_smallest_clusters(scripted, tmp_path):
    # every C passes at k=16 (largest drop 40/10*1.41 = 5.7): C goes down to 10, and no larger k is tried
    result = scripted_tune(tmp_path, budget=6.0, modes="i-clustered", layers="all")
    assert tried(result) == [(100, 16), (50, 16), (25, 16), (10, 16)]
    assert (result.chosen.config.clusters, result.chosen.config.topk) == (10, 16)


def test_every_mode_of_the_config_is_tried_and_k_only_where_it_matters(scripted, tmp_path):
    result = scripted_tune(tmp_path, budget=0.5, layers="all")
    assert {c.config.mode for c in result.candidates} == set(MODES)
    for mode in MODES:
        topks = {k for _, k in tried(result, mode=mode)}
        assert len(topks) > 1 if uses_topk(mode) else topks == {32}, (mode, topks)


def test_layer_search_binary_searches_a_prefix_and_a_suffix(scripted, tmp_path):
    # With every C failing at budget 0.1, the anchor is the failing point nearest the budget: C=100
    # (drop 0.57 at k=16 with 6 layers; 0.40 at k=32, 0.28 at k=64). At k=64 a patched prefix of m layers
    # drops 0.283 * m / 6: m = 2 is the longest within 0.1.
    result = scripted_tune(tmp_path, budget=0.1, modes="i-clustered", layers="search")
    layer_runs = [c for c in result.candidates if c.stage == "layers"]
    assert {c.config.clusters for c in layer_runs} == {100} and {c.config.topk for c in layer_runs} == {64}
    assert len(layer_runs) <= 2 * math.ceil(math.log2(6))  # binary search, not every length
    passing = [c.config.layers for c in layer_runs if c.ok]
    assert (0, 1) in passing and (4, 5) in passing
    assert not any(c.ok and len(c.config.layers) > 2 for c in layer_runs)
    assert result.chosen.config.layers in ((0, 1), (4, 5))


def test_screening_drops_candidates_far_out_of_budget_before_the_full_slice(scripted, tmp_path, monkeypatch):
    # dropped when more than 0.5 + 0.15 points down on the first 2000 examples (0.15: three examples'
    # worth, more than the margin 0.1): C=50 at k=32 (0.8)
    monkeypatch.setattr(ScriptedSession, "default_count", 4000)
    result = scripted_tune(
        tmp_path, budget=0.5, modes="i-clustered", layers="all", screen=2000, screen_margin=0.1
    )
    full, chunk = scripted
    assert chunk.limit == 2000 and result.screen_examples == 2000
    screened = [c for c in result.candidates if c.status == "screened out"]
    assert screened and all(c.runs == [] and c.speedup is None for c in screened)
    assert [(c.config.clusters, c.config.topk) for c in screened] == [(50, 32)]
    scored_in_full = [config for config in full.calls if config is not None]
    assert len(scored_in_full) == len(result.candidates) - len(screened)
    assert all(penalty(config) <= 0.65 for config in scored_in_full)


def test_a_budget_nobody_meets_recommends_the_unmodified_model(scripted, tmp_path):
    result = scripted_tune(tmp_path, budget=0.0, modes="i-clustered", layers="all", output=tmp_path / "out")
    assert result.chosen is None and result.config is None
    assert "keep the unmodified model" in result.recommendation
    written = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert written["chosen"] is None and written["chosen_config"] is None
    assert not (tmp_path / "out" / "clustered-attention.json").exists()
    with pytest.raises(UserError, match="chose no settings"):
        load_config(tmp_path / "out" / "tune.json")


def test_cost_model_choice_and_the_written_table(scripted, tmp_path):
    by_speed = scripted_tune(
        tmp_path, budget=1.0, modes="i-clustered", layers="all", cost="speed", output=tmp_path / "a"
    )
    by_model = scripted_tune(tmp_path, budget=1.0, modes="i-clustered", layers="all")  # the default
    passing = [c for c in by_model.candidates if c.ok]
    assert by_model.chosen.cost == min(c.cost for c in passing)
    assert by_speed.chosen.speedup == max(c.speedup for c in by_speed.candidates if c.ok)
    markdown = (tmp_path / "a" / "tune.md").read_text()
    assert "← chosen" in markdown and by_speed.chosen.label in markdown
    assert (tmp_path / "a" / "tune.png").stat().st_size > 0
    saved = json.loads((tmp_path / "a" / "clustered-attention.json").read_text())
    assert ClusteredAttentionConfig.from_dict(saved) == by_speed.config
    again = TuneResult.from_dict(json.loads((tmp_path / "a" / "tune.json").read_text()))
    assert again.to_dict() == by_speed.to_dict() and again.chosen.label == by_speed.chosen.label


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": -1}, "budget must be a number"),
        ({"budget": float("nan")}, "budget must be a number"),
        ({"task": "rte,mrpc"}, "one task name"),
        ({"task": "nope"}, "unknown task"),
        ({"clusters": "10,x"}, "malformed cluster list"),
        ({"topk": "0"}, "malformed topk list"),
        ({"modes": ["fast"]}, "unknown mode(s) ['fast']"),
        ({"metric": "bleu"}, "has no metric ['bleu']"),
        ({"layers": "some"}, "layers must be"),
        ({"cost": "money"}, "cost must be one of"),
        ({"screen": -3}, "screen must be"),
        ({"limit": 0}, "limit must be"),
        ({"attention": {"bits": 99}}, "bits must be"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(scripted, tmp_path, kwargs, message):
    kwargs = {"task": "mrpc", **kwargs}
    task = kwargs.pop("task")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        tune(folder, task, **kwargs)
    assert scripted == []  # no session was made


# --- tiny real models --------------------------------------------------------------------------------


def test_tune_on_a_tiny_model_within_budget_and_the_saved_config_round_trips(tiny_cls, tiny_rte, tmp_path):
    out, saved_model = tmp_path / "out", tmp_path / "converted"
    result = tune(
        tiny_cls, "rte", budget=13.0, clusters="2,4", topk="2,4", data_dir=tiny_rte, limit=8, batch_size=4,
        output=out, save_model=saved_model,
    )  # fmt: skip
    assert result.unmodified.clusters is None and result.examples == 8
    assert result.chosen is not None, result.recommendation
    assert all(change >= -13.0 for change in result.chosen.changes.values())
    # the verdict is reproducible: the chosen settings scored again give the same change
    session = TaskSession(get_tasks("rte")[0], str(tiny_cls), data_dirs=[tiny_rte], limit=8, batch_size=4)
    base, again = session.score(None), session.score(result.config)
    assert again.scores["accuracy"] - base.scores["accuracy"] == pytest.approx(
        result.chosen.changes["accuracy"]
    )
    # the saved settings go into convert as they are
    config = ClusteredAttentionConfig.from_dict(json.loads((out / "clustered-attention.json").read_text()))
    assert config == result.config == load_config(out / "tune.json")
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(tiny_cls).eval()
    bert_cluster.convert(model, config=config)
    stored = {
        k: v for k, v in model.config.clustered_attention.items() if k != "original_attn_implementation"
    }
    assert stored == config.to_dict()
    reloaded = BertForSequenceClassification.from_pretrained(saved_model).eval()
    assert reloaded.config.clustered_attention == model.config.clustered_attention
    inputs = {
        "input_ids": torch.randint(5, 40, (2, 30)),
        "attention_mask": torch.ones(2, 30, dtype=torch.long),
    }
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits)
    document = json.loads((out / "tune.json").read_text())
    assert document["candidates"][document["chosen"]]["config"] == config.to_dict()
    assert sorted(document["files"]) == ["clustered-attention.json", "tune.json", "tune.md", "tune.png"]


cli = CliRunner()


def test_cli_tune_prints_the_table_and_refuses_bad_input(tiny_cls, tiny_rte, tmp_path):
    out = tmp_path / "out"
    arguments = ["tune", str(tiny_cls), "-t", "rte", "--data-dir", str(tiny_rte), "--limit", "8"]
    result = cli.invoke(app, [*arguments, "-c", "2,4", "--topk", "4", "--mode", MODES[0], "--budget", "100",
                              "--layers", "all", "--cost", "attention", "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "recommendation:" in result.stdout and "in budget" in result.stdout
    assert f"{MODES[0]} C=2 k=4 layers=all" in result.stdout  # every candidate passes: the least work
    assert "in budget" in result.stderr  # progress lines, one per candidate
    for arguments_, message in (
        ([*arguments, "--budget", "-1"], "budget must be"),
        ([*arguments, "-o", str(out)], "is not empty"),
        ([*arguments, "--layers", "a,b"], "malformed layer list"),
        (["tune", str(tiny_cls), "-t", "rte,mrpc"], "one task name"),
    ):
        refused = cli.invoke(app, arguments_)
        assert refused.exit_code == 2, refused.output
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in refused.output, refused.stderr


def test_attention_cost_model():
    config = ClusteredAttentionConfig(clusters=25, topk=32)
    assert attention_cost(config, LAYERS, 570.0, True) == pytest.approx(57 / 570)
    assert attention_cost(config, LAYERS, 570.0, False) == pytest.approx(25 / 570)
    assert attention_cost(config.replace(layers=(0, 1, 2)), LAYERS, 570.0, True) == pytest.approx(
        (0.1 + 1) / 2
    )
    assert attention_cost(config, LAYERS, 20.0, True) == 1.0  # rows of at most C tokens are exact


def test_seeds_are_averaged_per_candidate(scripted, tmp_path):
    result = scripted_tune(tmp_path, budget=6.0, modes="i-clustered", layers="all", seeds=2)
    (session,) = scripted
    assert all([run.seed for run in candidate.runs] == [0, 1] for candidate in result.candidates)
    assert len(session.calls) == 1 + 2 * len(result.candidates)


def test_screening_slack_is_at_least_three_examples_worth():
    assert tuner_module.screen_slack(2.0, 69) == pytest.approx(300 / 69)  # 4.35: 1 example = 1.45 points
    assert tuner_module.screen_slack(2.0, 1000) == 2.0
    assert tuner_module.screen_slack(2.0, None) == 2.0


def test_ctrl_c_keeps_the_candidates_scored_so_far(scripted, tmp_path, monkeypatch):
    from bert_cluster.evaluation import TuneInterrupted

    original = ScriptedSession.score

    def score(self, config):
        if len(self.calls) == 3:
            raise KeyboardInterrupt
        return original(self, config)

    monkeypatch.setattr(ScriptedSession, "score", score)
    with pytest.raises(TuneInterrupted) as caught:
        scripted_tune(tmp_path, budget=6.0, modes="i-clustered", layers="all", output=tmp_path / "out")
    assert len(caught.value.result.candidates) == 2 and "interrupted" in caught.value.result.notes[0]
    written = json.loads(caught.value.written.read_text())
    assert len(written["candidates"]) == 2 and written["chosen"] is not None
