"""benchmarks/long_document_training.py (issue 40, item 3): the split, the verdicts, and a run end to end on a
small random sentence-transformer with seconds-long budgets (each arm a ``bert_cluster.finetune`` run of
the task ``squad-articles-train``, whose kind holds the recipe's rows and loss)."""

from __future__ import annotations

import json

import pytest
from helpers import save_sentence_transformer

from benchmarks import long_document_training
from bert_cluster.tasks.kinds import long_retrieval


def load_articles() -> long_retrieval.Articles:
    """The 48 articles of the packaged file, read apart from the task (what the split is checked against)."""
    import gzip

    from bert_cluster.datafiles import PACKAGE_DATA

    with gzip.open(PACKAGE_DATA / "squad_v1_dev_retrieval.json.gz", "rt", encoding="utf-8") as handle:
        document = json.load(handle)
    return long_retrieval.articles_from_paragraphs(document["paragraphs"], document["questions"])


def test_the_split_trains_on_articles_1_to_24_and_scores_25_to_48():
    articles = load_articles()
    pairs, held_out = long_document_training.split(long_document_training.TASK, eval_every=1, length=4096)
    cut = [document[: 12 * 4096] for document in articles.documents]
    training_documents = {document for _, document in pairs}
    assert training_documents == set(cut[:24])
    assert set(held_out["corpus"].values()) == set(cut[24:])
    assert not training_documents & set(held_out["corpus"].values())
    assert len(pairs) + len(held_out["queries"]) == len(articles.questions)
    for qid, relevant in held_out["relevant"].items():
        assert relevant <= set(held_out["corpus"]) and qid in held_out["queries"]


def _result(exact: list[tuple[float, float]], clustered: list[tuple[float, float]]) -> dict:
    def points(rows):
        return [{"budget": b, "seconds": b, "R@1": r, "MRR@10": r} for b, r in [(0, 10.0), *rows]]

    return {"variants": {"exact": {"points": points(exact)}, "clustered": {"points": points(clustered)}}}


@pytest.mark.parametrize(
    "exact, clustered, every_budget, half_time",
    [
        ([(100, 20.0), (200, 30.0)], [(100, 31.0), (200, 40.0)], True, True),  # exact's final 30 by 100 s
        ([(100, 20.0), (200, 30.0)], [(100, 25.0), (200, 35.0)], True, False),  # 30 only at 200 s
        ([(100, 20.0), (200, 30.0)], [(100, 19.0), (200, 35.0)], False, False),  # behind at 100 s
        ([(100, 20.0), (200, 30.0)], [(100, 20.0), (200, 29.0)], False, False),  # never reaches 30
    ],
)
def test_the_verdicts_read_the_scores(exact, clustered, every_budget, half_time):
    verdicts = long_document_training.verdicts(_result(exact, clustered))
    assert verdicts["at_least_exact_at_every_budget"] is every_budget
    assert verdicts["exact_final_within_half_time"] is half_time


@pytest.mark.slow
def test_the_cut_before_tokenising_keeps_every_token_the_model_sees():
    from transformers import AutoTokenizer

    from bert_cluster.checkpoints import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    articles = load_articles()
    pairs, _ = long_document_training.split(long_document_training.TASK, eval_every=1, length=4096)
    for document in {document for _, document in pairs}:
        whole = next(d for d in articles.documents if d.startswith(document))
        kept = tokenizer(document, truncation=True, max_length=4096)["input_ids"]
        assert kept == tokenizer(whole, truncation=True, max_length=4096)["input_ids"]


@pytest.mark.slow(
    reason="two short training runs of the long-document recipe (exact and clustered), scored at each budget"
)
def test_a_short_run_writes_both_runs_scores_at_every_budget(tmp_path):
    model = save_sentence_transformer(tmp_path / "st", max_seq_length=64)
    output = tmp_path / "out" / "training.json"
    arguments = ["--minilm-16k", str(model), "--length", "64", "--budgets", "1", "2", "--eval-every", "60"]
    arguments += ["--batch-size", "4", "--work", str(tmp_path / "work"), "--output", str(output)]
    assert long_document_training.main(arguments) == 0
    result = json.loads(output.read_text())
    for variant in ("exact", "clustered"):
        run = result["variants"][variant]
        assert [p["budget"] for p in run["points"]] == [0, 1, 2] and not run["unreached_budgets"]
        seconds = [p["seconds"] for p in run["points"]]
        assert seconds == sorted(seconds) and seconds[1] >= 1 and seconds[2] >= 2
        assert all(0 <= p["R@1"] <= 100 and 0 <= p["MRR@10"] <= 100 for p in run["points"])
        assert run["curve"] and all(c["loss"] > 0 for c in run["curve"])
    assert result["verdicts"] == long_document_training.verdicts(result)
    assert output.with_suffix(".md").read_text().count("\n") == 5  # header, rule, budgets 0, 1, 2
    assert output.with_suffix(".png").stat().st_size > 0


def test_the_growth_options_reach_convert_and_out_of_range_ones_exit_2(tmp_path, monkeypatch, capsys):
    import bert_cluster

    class Converted(Exception):
        """Stops the run at the clustered arm's fine-tuning call, which converts with these settings."""

    seen: dict = {}

    def finetune(model, task, output, **settings):
        seen.update(settings["attention"].to_dict())
        raise Converted

    monkeypatch.setattr(bert_cluster, "finetune", finetune)
    model = save_sentence_transformer(tmp_path / "st", max_seq_length=64)
    arguments = ["--minilm-16k", str(model), "--length", "64", "--budgets", "1", "--variants", "clustered"]
    arguments += ["--work", str(tmp_path / "work"), "--output", str(tmp_path / "out.json")]
    with pytest.raises(Converted):
        long_document_training.main([*arguments, "--cluster-growth", "0.75", "--topk-growth", "0.25"])
    assert seen["cluster_growth"] == 0.75 and seen["topk_growth"] == 0.25
    for option, value in [("--cluster-growth", "1.5"), ("--topk-growth", "-0.1")]:
        with pytest.raises(SystemExit) as stop:
            long_document_training.main([*arguments, option, value])
        assert stop.value.code == 2 and f"{option} must be in 0..1" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow(
    reason="a short clustered training run of the long-document recipe, its copies scored twice"
)
def test_the_clustered_copies_scored_with_exact_attention_too(tmp_path):
    """--score-exact-too: untrained, the clustered model scored with exact attention is the exact model,
    so its scores equal the exact run's; the model goes back to clustered attention for its training."""
    model = save_sentence_transformer(tmp_path / "st", max_seq_length=64)
    output = tmp_path / "out" / "training.json"
    arguments = ["--minilm-16k", str(model), "--length", "64", "--budgets", "1", "--eval-every", "60"]
    # every row approximated: 64 tokens are under the "auto" minimum
    arguments += [
        "--batch-size",
        "4",
        "--clusters",
        "2",
        "--min-length",
        "0",
        "--work",
        str(tmp_path / "work"),
    ]
    assert long_document_training.main([*arguments, "--output", str(output), "--score-exact-too"]) == 0
    result = json.loads(output.read_text())
    exact, clustered = (result["variants"][v] for v in ("exact", "clustered"))
    assert all("exact_attention" not in p for p in exact["points"])
    assert all(0 <= p["exact_attention"]["R@1"] <= 100 for p in clustered["points"])
    assert clustered["points"][0]["exact_attention"] == {k: exact["points"][0][k] for k in ("R@1", "MRR@10")}
    assert "scored exact" in output.with_suffix(".md").read_text()
    # trained with clustered attention after the rescoring: its first loss is not the exact run's, and it
    # is the first loss of a clustered run that never rescored
    assert clustered["curve"][0]["loss"] != exact["curve"][0]["loss"]
    again = tmp_path / "again" / "training.json"
    assert long_document_training.main([*arguments, "--output", str(again), "--variants", "clustered"]) == 0
    alone = json.loads(again.read_text())["variants"]["clustered"]
    assert alone["curve"][0]["loss"] == clustered["curve"][0]["loss"]


def test_each_row_holds_questions_of_one_article_and_every_question_is_used():
    pairs = [(f"q{a}-{i}", f"article {a}") for a in range(3) for i in range(7 + a)]
    rows = long_retrieval.article_rows(pairs, questions_per_article=4, seed=0)
    columns = rows["columns"]
    assert list(columns) == ["question_0", "question_1", "question_2", "question_3", "article", "label"]
    asked = {(q, d) for q, d in pairs}
    seen = set()
    for r, article in enumerate(columns["article"]):
        questions = [columns[f"question_{j}"][r] for j in range(4)]
        assert len(set(questions)) == 4 and all((q, article) in asked for q in questions)
        assert rows["documents"][columns["label"][r]] == article
        seen.update(questions)
    assert seen == {q for q, _ in pairs}
    assert len(columns["article"]) == 2 + 2 + 3  # ceil(7/4), ceil(8/4) and ceil(9/4) rows
    assert (
        long_retrieval.article_rows(pairs, 4, seed=0) == rows
        and long_retrieval.article_rows(pairs, 4, seed=1) != rows
    )


def _features(model, texts):
    return model.preprocess(texts)


def test_the_loss_with_one_question_per_article_is_sentence_transformers_in_batch_loss(tmp_path):
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(str(save_sentence_transformer(tmp_path / "st")), device="cpu").eval()
    questions = ["who won the cup", "where is the river", "when was it built"]
    articles = ["the cup final was won by", "a river runs through the town", "the tower was built in"]
    features = [_features(model, questions), _features(model, articles)]
    labels = torch.tensor([0, 1, 2])
    ours = long_retrieval.article_retrieval_loss(model, articles, bank=False)(features, labels)
    theirs = MultipleNegativesRankingLoss(model)(features, labels)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours > 0


def test_the_bank_adds_the_other_training_articles_as_negatives_and_keeps_their_last_embedding(tmp_path):
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(save_sentence_transformer(tmp_path / "st")), device="cpu").eval()
    documents = [f"article number {i} about topic {i * 7}" for i in range(6)]
    questions = [["what is topic 0"], ["what is topic 14"]]
    batch = [0, 2]
    features = [_features(model, [q[0] for q in questions]), _features(model, [documents[i] for i in batch])]
    labels = torch.tensor(batch)
    with torch.no_grad():
        plain = long_retrieval.article_retrieval_loss(model, documents, bank=False)(features, labels)
        banked_loss = long_retrieval.article_retrieval_loss(model, documents, bank=True)
        banked = banked_loss(features, labels)
        embeddings = model.encode(documents, convert_to_tensor=True, normalize_embeddings=True)
        scores = (
            20
            * model.encode([q[0] for q in questions], convert_to_tensor=True)
            @ torch.cat([embeddings[batch], embeddings[[1, 3, 4, 5]]]).T
        )
    torch.testing.assert_close(banked, torch.nn.functional.cross_entropy(scores, torch.tensor([0, 1])))
    assert banked > plain  # four more negatives
    torch.testing.assert_close(banked_loss.bank, embeddings, rtol=1e-5, atol=1e-6)


def _seeded(seed: int, exact: list[tuple[float, float]], clustered: list[tuple[float, float]]) -> dict:
    result = _result(exact, clustered)
    result["settings"] = {"seed": seed, "length": 4096}
    return result


def test_the_seeds_plot_shows_clustered_minus_exact_at_the_budgets_every_seed_reached(tmp_path):
    runs = [
        _seeded(0, [(100, 20.0), (200, 30.0)], [(100, 19.0), (200, 33.0)]),
        _seeded(1, [(100, 22.0), (200, 31.0), (400, 32.0)], [(100, 23.0), (200, 30.0), (400, 35.0)]),
    ]
    # 400 s was reached by one seed only: it is left out, not averaged over one run
    assert long_document_training.differences_at_budgets(runs) == {100: [-1.0, 1.0], 200: [3.0, -1.0]}
    files = []
    for index, run in enumerate(runs):
        files.append(tmp_path / f"seed{index}.json")
        files[-1].write_text(json.dumps(run))
    output = tmp_path / "plots" / "seeds.png"
    assert long_document_training.main(["--plot-seeds", *map(str, files), "--output", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_seeds_plot_refuses_a_run_without_both_variants_and_a_non_png_output(tmp_path, capsys):
    run = _seeded(0, [(100, 20.0)], [(100, 21.0)])
    del run["variants"]["clustered"]
    path = tmp_path / "exact_only.json"
    path.write_text(json.dumps(run))
    for output, message in [
        ("seeds.png", "lack an exact or a clustered run"),
        ("seeds.json", "writes a .png"),
    ]:
        with pytest.raises(SystemExit) as stop:
            long_document_training.main(["--plot-seeds", str(path), "--output", str(tmp_path / output)])
        assert stop.value.code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / output).exists()
