"""``bert_cluster.embed`` / ``bert-cluster embed``: inputs, equality with encode, resume, lock, processes."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import bert_cluster
from bert_cluster.cli import app
from bert_cluster.embedding import plan, read_documents, read_output, store
from bert_cluster.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SQUAD = REPO / "bert_cluster" / "data" / "squad_v1_dev_retrieval.json.gz"
#: Settings that make every run of a test approximate the same rows whatever the machine measured
#: (min_length="auto" is a per-machine crossover), and give several shards and batches.
SMALL = {"shard_size": 4, "max_tokens_per_batch": 600}
CLUSTERED = {"min_length": 0, "clusters": 4, "topk": 8}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """14 SQuAD paragraph openings of 5 to ~160 words: several lengths, so batches differ in padding."""
    paragraphs = json.loads(gzip.decompress(SQUAD.read_bytes()))["paragraphs"]
    return [" ".join(p["context"].split()[: 5 + (i * 37) % 160]) for i, p in enumerate(paragraphs[:28:2])]


@pytest.fixture()
def corpus(tmp_path, texts) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def matrix(output: Path) -> tuple[list[str], np.ndarray]:
    table = read_output(output)
    return table.column("id").to_pylist(), np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


def encoded(model_dir: Path, texts: list[str], attention: dict | None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = 512
    if attention is not None:
        bert_cluster.convert(model, **attention)
    return model.encode(texts, batch_size=32, convert_to_numpy=True)


# --------------------------------------------------------------------------------------------------
# Inputs and plan (no model)
# --------------------------------------------------------------------------------------------------


def test_text_file_problems_are_reported_by_line_and_never_embedded(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"\xef\xbb\xbffirst\r\n\n   \t\nbad \xff\xfe bytes\nlast\n")
    read = read_documents(path)
    assert [(d.id, d.text, d.line) for d in read.documents] == [("1", "first", 1), ("5", "last", 5)]
    assert [(p.line, p.reason) for p in read.problems] == [
        (2, "empty"),
        (3, "whitespace only"),
        (4, "not valid UTF-8 (byte 5 of the line)"),
    ]


def test_table_inputs_through_datasets(tmp_path):
    rows = [{"doc": "a", "body": "alpha"}, {"doc": "b", "body": None}, {"doc": "a", "body": "again"}]
    rows.append({"doc": "c", "body": "gamma"})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    read = read_documents(tmp_path / "d.jsonl", text_field="body", id_field="doc")
    assert [(d.id, d.text, d.line) for d in read.documents] == [("a", "alpha", 1), ("c", "gamma", 4)]
    assert [(p.id, p.line, p.reason) for p in read.problems] == [
        ("b", 2, "no text (missing or null)"),
        ("a", 3, "repeated id (first at line 1)"),
    ]
    import datasets

    table = datasets.Dataset.from_list([{"text": "x y"}, {"text": "z"}])
    table.to_csv(str(tmp_path / "d.csv"))
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for source in ("d.csv", "d.parquet", "saved"):
        assert [d.text for d in read_documents(tmp_path / source).documents] == ["x y", "z"], source
    (tmp_path / "nested.json").write_text(json.dumps({"items": [{"text": "q"}]}), encoding="utf-8")
    assert [d.text for d in read_documents(tmp_path / "nested.json", json_field="items").documents] == ["q"]
    with pytest.raises(UserError, match="--text-field 'nope' is not a column"):
        read_documents(tmp_path / "d.csv", text_field="nope")
    with pytest.raises(UserError, match="does not exist"):
        read_documents(tmp_path / "missing.jsonl")


def test_squad_articles_are_packaged():
    read = read_documents("package:squad-articles")
    assert len(read.documents) == 48 and not read.problems
    paragraphs = json.loads(gzip.decompress(SQUAD.read_bytes()))["paragraphs"]
    first = [p["context"] for p in paragraphs if p["id"].startswith("Super_Bowl_50/")]
    assert read.documents[0].id == "Super_Bowl_50" and read.documents[0].text == "\n\n".join(first)


def test_plan_keeps_the_budget_and_the_input_order():
    lengths = [5, 50, 7, 300, 20, 20, 9, 1000, 3]
    shards = plan.make_plan(lengths, shard_size=4, budget=100)
    assert [list(s.documents) for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert shards[0].batches == ((3,), (1, 2), (0,))  # longest first; 2 x 50 fits, 3 x 50 does not
    for shard in shards:
        assert sorted(p for batch in shard.batches for p in batch) == list(shard.documents)
        for batch in shard.batches:  # rows x longest row within the budget, unless one row alone is over
            assert len(batch) == 1 or len(batch) * max(lengths[p] for p in batch) <= 100


# --------------------------------------------------------------------------------------------------
# Equality with SentenceTransformer.encode
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "converted"])
def test_embed_equals_sentence_transformer_encode(minilm_dir, corpus, texts, tmp_path, exact):
    result = bert_cluster.embed(
        minilm_dir, corpus, tmp_path / "out", exact=exact, attention=CLUSTERED, **SMALL
    )
    assert result.documents == len(texts) and result.shards == 4 and result.truncated == 0
    ids, ours = matrix(tmp_path / "out")
    assert ids == [str(n) for n in range(1, len(texts) + 1)]
    reference = encoded(minilm_dir, texts, None if exact else CLUSTERED)
    # Batches of other composition pad differently: measured max |diff| 1.2e-7 (exact and converted,
    # 20 SQuAD texts, batches of 32 and of 1); converted (C = 25) vs exact: 1.8e-2, far above this.
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-6)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["model"]["modules"] == ["Transformer", "Pooling", "Normalize"]
    assert manifest["settings"]["attention"] == (None if exact else result.manifest["settings"]["attention"])
    assert manifest["counts"] == {"documents": 14, "embedded": 14, "truncated": 0, "problems": 0}
    assert manifest["this_run"]["documents_per_second"] > 0


# --------------------------------------------------------------------------------------------------
# Streaming: one shard of documents at a time, the output of the whole-corpus implementation
# --------------------------------------------------------------------------------------------------


def whole_corpus_embed(model_dir: Path, path: Path, attention: dict, max_length: int) -> dict:
    """What ``embed`` wrote before it streamed (main at cad4b64), computed its way as the oracle.

    The whole corpus read (``read_documents``) and tokenised first, ``make_plan`` over every document,
    then each planned batch encoded: ids, embeddings, token counts, truncation flags and problems.
    """
    import torch

    from bert_cluster import hf
    from bert_cluster.checkpoints import load_sentence_encoder
    from bert_cluster.embedding import run

    corpus = read_documents(path)
    model, _ = load_sentence_encoder(model_dir, "cpu")
    model.max_seq_length = max_length
    hf.convert(model, config=run._attention_config(attention))
    texts = [document.text for document in corpus.documents]
    counts = plan.count_tokens(
        model.tokenizer, texts, lowercase=bool(getattr(model[0], "do_lower_case", False))
    )
    lengths = [min(count, max_length) for count in counts]
    rows = {}
    with torch.inference_mode():
        for shard in plan.make_plan(lengths, SMALL["shard_size"], SMALL["max_tokens_per_batch"]):
            for batch in shard.batches:
                vectors = model.encode(
                    [texts[p] for p in batch],
                    batch_size=len(batch),
                    convert_to_tensor=True,
                    show_progress_bar=False,
                )
                rows.update(zip(batch, vectors.float().cpu().numpy(), strict=True))
    return {
        "id": [document.id for document in corpus.documents],
        "embedding": np.stack([rows[p] for p in range(len(texts))]),
        "tokens": counts,
        "truncated": [count > max_length for count in counts],
        "problems": [problem.to_dict() for problem in corpus.problems],
    }


def written(output: Path) -> dict:
    table = read_output(output)
    manifest = json.loads((output / "manifest.json").read_text())
    return {
        "id": table.column("id").to_pylist(),
        "embedding": np.stack(table.column("embedding").to_numpy(zero_copy_only=False)),
        "tokens": table.column("tokens").to_pylist(),
        "truncated": table.column("truncated").to_pylist(),
        "problems": manifest["problems"],
    }


def assert_same_output(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        if name == "embedding":
            assert ours[name].shape == theirs[name].shape
            assert np.array_equal(ours[name].view(np.uint32), theirs[name].view(np.uint32))  # bit for bit
        else:
            assert ours[name] == theirs[name], name


def test_streaming_embed_writes_what_the_whole_corpus_implementation_did(minilm_dir, texts, tmp_path):
    # Problems in the middle (empty, whitespace, not UTF-8) and documents over max_length.
    lines = [text.encode() for text in texts]
    lines[3:3] = [b"", b"  \t", b"bad \xff bytes"]
    docs = tmp_path / "docs.txt"
    docs.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    result = bert_cluster.embed(minilm_dir, docs, out, attention=CLUSTERED, max_length=64, **SMALL)
    oracle = whole_corpus_embed(minilm_dir, docs, CLUSTERED, 64)
    assert_same_output(written(out), oracle)
    assert result.truncated == sum(oracle["truncated"]) > 0 and len(result.problems) == 3
    # Resumed mid-corpus (shards 1 and 3 and the manifest gone): the same output, the same counts.
    manifest = json.loads((out / "manifest.json").read_text())
    for name in ("shard-00001.parquet", "shard-00003.parquet", "manifest.json"):
        (out / name).unlink()
    resumed = bert_cluster.embed(minilm_dir, docs, out, attention=CLUSTERED, max_length=64, **SMALL)
    assert resumed.resumed_shards == 2 and resumed.shards == 4
    assert_same_output(written(out), oracle)
    assert resumed.truncated == result.truncated
    assert json.loads((out / "manifest.json").read_text())["counts"] == manifest["counts"]


def test_the_first_shard_is_written_before_the_input_is_read_to_its_end(
    minilm_dir, corpus, tmp_path, monkeypatch
):
    from bert_cluster.embedding import documents

    out = tmp_path / "out"
    on_disk = []  # the shards on disk when each document was read
    read = documents.Input.documents

    def watched(self):
        for document in read(self):
            on_disk.append(len(list(out.glob("shard-*.parquet"))))
            yield document

    monkeypatch.setattr(documents.Input, "documents", watched)
    bert_cluster.embed(minilm_dir, corpus, out, exact=True, **SMALL)
    # Shards of 4 documents: shard n is on disk before document 4n + 1 is read, and no document is read
    # before it is needed.
    assert on_disk == [position // 4 for position in range(14)]


def test_an_input_that_shrinks_between_the_passes_is_refused(minilm_dir, corpus, tmp_path, monkeypatch):
    from bert_cluster.embedding import documents

    read = documents.Input.documents
    monkeypatch.setattr(
        documents.Input, "documents", lambda self: (d for d in itertools.islice(read(self), 9))
    )
    with pytest.raises(
        UserError, match="the input changed while it was read: 9 documents where its first pass"
    ):
        bert_cluster.embed(minilm_dir, corpus, tmp_path / "out", exact=True, **SMALL)
    assert sorted(p.name for p in (tmp_path / "out").glob("shard-*")) == [
        "shard-00000.parquet",
        "shard-00001.parquet",
    ]


def test_dense_modules_and_a_plain_encoder_folder(tmp_path):
    import helpers

    folder = helpers.save_sentence_transformer(tmp_path / "st", dense=16, normalize=False)
    docs = tmp_path / "d.txt"
    docs.write_text("one two three\nfour five\nsix seven eight nine\n", encoding="utf-8")
    result = bert_cluster.embed(folder, docs, tmp_path / "out", exact=True, max_length=64)
    assert result.dimension == 16 and result.manifest["model"]["dense"] is True
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folder), device="cpu").encode(docs.read_text().split("\n")[:3])
    np.testing.assert_allclose(matrix(tmp_path / "out")[1], reference, rtol=0, atol=1e-6)
    plain = bert_cluster.embed(tmp_path / "st-bert", docs, tmp_path / "plain", exact=True)
    assert plain.manifest["model"]["pooling"] == "mean"
    assert plain.manifest["model"]["sentence_transformers_folder"] is False
    assert "mean pooling" in plain.manifest["model"]["note"]


def test_truncation_is_counted(minilm_dir, corpus, texts, tmp_path):
    result = bert_cluster.embed(minilm_dir, corpus, tmp_path / "out", exact=True, max_length=32)
    table = read_output(tmp_path / "out")
    counts = table.column("tokens").to_pylist()
    assert result.truncated == sum(count > 32 for count in counts) > 0
    assert table.column("truncated").to_pylist() == [count > 32 for count in counts]
    assert max(counts) > 100  # the untruncated count, not the 32 the model saw


# --------------------------------------------------------------------------------------------------
# The output folder: other settings, lock, bad documents through the CLI
# --------------------------------------------------------------------------------------------------


def test_other_settings_are_refused_and_the_same_run_is_complete(minilm_dir, corpus, tmp_path):
    out = tmp_path / "out"
    first = bert_cluster.embed(minilm_dir, corpus, out, exact=True, **SMALL)
    again = bert_cluster.embed(minilm_dir, corpus, out, exact=True, **SMALL)
    assert again.resumed_shards == first.shards and again.manifest == first.manifest
    with pytest.raises(UserError, match=r"other settings: max_length \(there 512, now 64\).*--overwrite"):
        bert_cluster.embed(minilm_dir, corpus, out, exact=True, max_length=64, **SMALL)
    with pytest.raises(
        UserError, match=r"other settings: attention \(there null, now \{.*; exact \(there true, now false\)"
    ):
        bert_cluster.embed(minilm_dir, corpus, out, **SMALL)
    replaced = bert_cluster.embed(minilm_dir, corpus, out, exact=True, max_length=64, overwrite=True, **SMALL)
    assert replaced.resumed_shards == 0 and replaced.manifest["settings"]["max_length"] == 64
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty and holds no embed run"):
        bert_cluster.embed(minilm_dir, corpus, tmp_path / "busy", exact=True)


def test_lock_refuses_a_second_process(minilm_dir, corpus, tmp_path):
    out = tmp_path / "out"
    with store.locked(out):
        with pytest.raises(UserError, match="being written by another embed run"):
            bert_cluster.embed(minilm_dir, corpus, out, exact=True)
        result = CliRunner().invoke(app, ["embed", str(minilm_dir), str(corpus), "-o", str(out), "--exact"])
        assert result.exit_code == 2 and "being written by another embed run" in result.output
    assert not list(out.glob("shard-*"))
    assert bert_cluster.embed(minilm_dir, corpus, out, exact=True).documents == 14  # free again


def test_cli_reports_bad_documents_and_one_line_errors(minilm_dir, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_bytes(b"a fine sentence\n\nbad \xff\nanother fine one\n  \n")
    runner = CliRunner()
    done = runner.invoke(app, ["embed", str(minilm_dir), str(docs), "-o", str(tmp_path / "out"), "--exact"])
    assert done.exit_code == 0, done.output
    assert "skipped 2 (line 2): empty" in done.output
    assert "skipped 3 (line 3): not valid UTF-8" in done.output
    assert "skipped 5 (line 5): whitespace only" in done.output
    assert "embedded 2 documents" in done.output and "3 skipped" in done.output
    assert matrix(tmp_path / "out")[0] == ["1", "4"]
    problems = json.loads((tmp_path / "out" / "manifest.json").read_text())["problems"]
    assert [(p["id"], p["line"]) for p in problems] == [("2", 2), ("3", 3), ("5", 5)]
    for arguments, message in [
        ([str(tmp_path / "nothing.txt")], "does not exist"),
        ([str(docs), "--dtype", "float16"], "dtype must be one of float32, bfloat16"),
        ([str(docs), "--max-length", "4096"], "more than the model's 512 positions"),
        ([str(docs), "--topk", "0"], "topk"),
    ]:
        failed = runner.invoke(app, ["embed", str(minilm_dir), *arguments, "-o", str(tmp_path / "e")])
        assert failed.exit_code == 2, failed.output
        lines = failed.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], failed.output
        assert not (tmp_path / "e").exists()  # a refused run leaves no folder behind


def test_quiet_still_names_the_skipped_documents(minilm_dir, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_bytes(b"a fine sentence\n\nbad \xff\n")
    done = CliRunner().invoke(
        app, ["embed", str(minilm_dir), str(docs), "-o", str(tmp_path / "o"), "--exact", "-q"]
    )
    assert done.exit_code == 0, done.output
    assert done.stderr.strip().splitlines() == [
        "skipped 2 (line 2): empty",
        "skipped 3 (line 3): not valid UTF-8 (byte 5 of the line)",
    ]
    assert done.stdout == ""


def test_the_lock_is_taken_before_any_work(minilm_dir, corpus, tmp_path, monkeypatch):
    from bert_cluster.embedding import run

    monkeypatch.setattr(run, "open_documents", lambda *a, **k: pytest.fail("input read before the lock"))
    monkeypatch.setattr(
        run, "open_sentence_encoder", lambda *a, **k: pytest.fail("model loaded before the lock")
    )
    with store.locked(tmp_path / "out"), pytest.raises(UserError, match="being written by another embed run"):
        bert_cluster.embed(minilm_dir, corpus, tmp_path / "out", exact=True)


def test_overwrite_removes_only_the_files_the_runs_state_lists(minilm_dir, corpus, tmp_path):
    # Someone else's files named like an embed run's, in a folder without an embed state: refused, kept.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    names = ["manifest.json", "shard-00000.parquet", "shard-00099.parquet"]
    for name in names:
        (foreign / name).write_text(f"not yours: {name}")
    with pytest.raises(
        UserError, match=r"holds files no embed run wrote there \(" + re.escape(", ".join(names))
    ):
        bert_cluster.embed(minilm_dir, corpus, foreign, exact=True, overwrite=True)
    assert [(p.name, p.read_text()) for p in sorted(foreign.glob("[ms]*"))] == [
        (name, f"not yours: {name}") for name in names
    ]
    # A finished run beside a shard of someone else's: refused, nothing removed.
    out = tmp_path / "out"
    bert_cluster.embed(minilm_dir, corpus, out, exact=True, **SMALL)
    (out / "shard-00099.parquet").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(
        UserError, match=r"\(shard-00099.parquet\): --overwrite removes only the files an embed"
    ):
        bert_cluster.embed(minilm_dir, corpus, out, exact=True, max_length=64, overwrite=True, **SMALL)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_damaged_state_is_refused_with_or_without_overwrite(minilm_dir, corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "state.json").write_text("{garbage")
    (out / "shard-00000.parquet").write_text("whose?")
    for overwrite in (False, True):
        with pytest.raises(
            UserError, match=r"state.json is damaged or no embed run's state.*remove them yourself"
        ):
            bert_cluster.embed(minilm_dir, corpus, out, exact=True, overwrite=overwrite)
    assert (out / "shard-00000.parquet").read_text() == "whose?"


def test_a_temporary_state_of_a_run_killed_at_its_start_is_no_obstacle(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".state.json.tmp-99").write_text("half")
    with store.locked(out):
        store.check_folder(out, overwrite=False)
        store.prepare(out, {"layout": store.LAYOUT_VERSION}, False, ["shard-00000.parquet"])
    assert sorted(p.name for p in out.iterdir()) == [".lock", "state.json"]
    assert json.loads((out / "state.json").read_text())["shards"] == ["shard-00000.parquet"]


def _flip_a_value(shard: Path) -> None:
    """Flip the exponent of the shard's first embedding value, inside its data (not the footer)."""
    import pyarrow.parquet as pq

    data = bytearray(shard.read_bytes())
    first = pq.read_table(shard).column("embedding")[0].values.to_numpy()[:4].astype("<f4").tobytes()
    at = bytes(data).find(first)
    assert at > 0
    data[at + 3] ^= 0x40
    shard.write_bytes(bytes(data))


def test_a_damaged_shard_is_named_by_read_output_and_embedded_again(minilm_dir, corpus, tmp_path):
    out = tmp_path / "out"
    bert_cluster.embed(minilm_dir, corpus, out, exact=True, **SMALL)
    ids, before = matrix(out)
    _flip_a_value(out / "shard-00001.parquet")
    with pytest.raises(
        UserError,
        match=r"shard shard-00001.parquet is damaged \(its content does not match its checksum\); run the",
    ):
        read_output(out)
    again = bert_cluster.embed(minilm_dir, corpus, out, exact=True, **SMALL)
    assert list(again.damaged_shards) == ["shard-00001.parquet"] and again.resumed_shards == again.shards - 1
    assert again.manifest["this_run"]["shards_damaged"] == again.damaged_shards
    after_ids, after = matrix(out)
    assert after_ids == ids and np.array_equal(after.view(np.uint32), before.view(np.uint32))
    # The command says so, -q or not.
    _flip_a_value(out / "shard-00000.parquet")
    arguments = ["embed", str(minilm_dir), str(corpus), "-o", str(out), "--exact", "-q"]
    arguments += ["--shard-size", "4", "--max-tokens-per-batch", "600"]
    rerun = CliRunner().invoke(app, arguments)
    assert rerun.exit_code == 0, rerun.output
    assert rerun.stderr.strip().splitlines() == [
        "re-embedded shard-00000.parquet: it was damaged (its content does not match its checksum)"
    ]
    # A shard cut short no longer reads as parquet: named too, not a raw ArrowInvalid.
    (out / "shard-00002.parquet").write_bytes((out / "shard-00002.parquet").read_bytes()[:-20])
    with pytest.raises(UserError, match=r"shard shard-00002.parquet is damaged \(it cannot be read: "):
        read_output(out)


def test_an_unwritable_output_is_one_line_and_exit_2(minilm_dir, corpus, tmp_path, monkeypatch):
    real_mkdir, real_replace = Path.mkdir, os.replace
    refused = tmp_path / "refused"

    def mkdir(self, *args, **kwargs):
        if self == refused:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    def replace(source, target, *args, **kwargs):  # a shard that cannot be written (permissions, disk full)
        if str(target).endswith(".parquet"):
            raise PermissionError(13, "Permission denied", str(target))
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(os, "replace", replace)
    runner = CliRunner()
    for out, message in [
        (refused, f"error: cannot write {refused}/.lock: Permission denied"),
        (tmp_path / "out", f"error: cannot write {tmp_path}/out/shard-00000.parquet: Permission denied"),
    ]:
        failed = runner.invoke(app, ["embed", str(minilm_dir), str(corpus), "-o", str(out), "--exact", "-q"])
        assert failed.exit_code == 2, failed.output
        assert failed.stderr.strip().splitlines() == [message]
    assert not list((tmp_path / "out").glob(".shard-*"))  # no temporary file left behind


# --------------------------------------------------------------------------------------------------
# Nothing lost: kill -9 between shards; several processes
# --------------------------------------------------------------------------------------------------

#: The CLI with the shard writer patched to kill its own process (SIGKILL, no clean-up) after 2 shards.
KILLED_AFTER_TWO_SHARDS = textwrap.dedent("""
    import os, signal, sys
    from bert_cluster.embedding import store
    real_write = store.write_shard
    written = []
    def write_then_die(*args, **kwargs):
        path = real_write(*args, **kwargs)
        written.append(path)
        if len(written) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    store.write_shard = write_then_die
    from bert_cluster.cli import main
    sys.argv = ["bert-cluster", *sys.argv[1:]]
    main()
""")


def _cli(launcher: list[str], arguments: list[str]) -> subprocess.CompletedProcess:
    # One thread per process in every run, so the only difference is what the test changes.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*launcher, *arguments], env=env, capture_output=True, text=True, timeout=600)


def _arguments(model: Path, corpus: Path, output: Path) -> list[str]:
    return [
        *("embed", str(model), str(corpus), "-o", str(output), "--quiet"),
        *("--shard-size", "4", "--max-tokens-per-batch", "600", "--min-length", "0", "--clusters", "4"),
        *("--topk", "8"),
    ]


@pytest.mark.slow(reason="a real MiniLM embedding a corpus twice, one run killed and resumed")
def test_killed_run_continues_and_equals_an_uninterrupted_one(minilm_dir, corpus, tmp_path):
    whole = _cli([sys.executable, "-m", "bert_cluster"], _arguments(minilm_dir, corpus, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "out"
    killed = _cli([sys.executable, "-c", KILLED_AFTER_TWO_SHARDS], _arguments(minilm_dir, corpus, out))
    assert killed.returncode == -9, killed.stderr[-3000:]
    first_two = sorted(out.glob("shard-*.parquet"))
    assert [p.name for p in first_two] == ["shard-00000.parquet", "shard-00001.parquet"]
    assert not (out / "manifest.json").exists()
    stamps = [p.stat().st_mtime_ns for p in first_two]
    resumed = _cli([sys.executable, "-m", "bert_cluster"], _arguments(minilm_dir, corpus, out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["this_run"]["shards_resumed"] == 2 and manifest["this_run"]["shards_written"] == 2
    assert [p.stat().st_mtime_ns for p in first_two] == stamps  # kept, not written again
    (ids, ours), (whole_ids, theirs) = matrix(out), matrix(tmp_path / "whole")
    assert ids == whole_ids
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # bit for bit


@pytest.mark.slow(reason="a real MiniLM embedding a corpus in one process and in two")
def test_two_processes_write_what_one_does(minilm_dir, corpus, tmp_path):
    one = _cli([sys.executable, "-m", "bert_cluster"], _arguments(minilm_dir, corpus, tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = _cli([*launcher, "-m", "bert_cluster"], _arguments(minilm_dir, corpus, tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["processes"] == 2 and manifest["this_run"]["documents"] == 14
    (ids, ours), (one_ids, theirs) = matrix(tmp_path / "two"), matrix(tmp_path / "one")
    assert ids == one_ids
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir()
    )


# --------------------------------------------------------------------------------------------------
# One test per defect of issue 69 (a changing corpus, swapped shards, the model's own folder)
# --------------------------------------------------------------------------------------------------

#: Six short documents, two to a shard.
SIX = ["one small text", "two more words", "three", "the fourth one", "five is here", "six and last"]
TWO_A_SHARD = {"shard_size": 2, "exact": True}


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory) -> Path:
    import helpers

    return helpers.save_sentence_transformer(tmp_path_factory.mktemp("tiny") / "st")


def _six(tmp_path: Path) -> Path:
    path = tmp_path / "six.txt"
    path.write_text("\n".join(SIX) + "\n", encoding="utf-8")
    return path


def _rewrite_after_shards(monkeypatch, count: int, path: Path, content: str) -> None:
    """``cat other > input`` once ``count`` shards are on disk, as a user changing the corpus would."""
    real = store.write_shard
    written = []

    def write_then_change(*args, **kwargs):
        result = real(*args, **kwargs)
        written.append(result)
        if len(written) == count:
            path.write_text(content, encoding="utf-8")
        return result

    monkeypatch.setattr(store, "write_shard", write_then_change)


def test_an_input_rewritten_in_place_is_refused_keeping_the_shards_written(
    tiny_encoder, tmp_path, monkeypatch
):
    """Issue 69: the first shards held the old text and the rest the new, exit 0, the manifest recording
    the old hash. Each shard's documents are checked before it is written, the rest at the end."""
    corpus, out = tmp_path / "long.txt", tmp_path / "out"
    # Documents of 4 kB: the reader's buffer (8 kB) then holds part of the input only when it changes.
    long = [f"{text} {'and more words ' * 260}" for text in SIX]
    corpus.write_text("\n".join(long) + "\n", encoding="utf-8")
    _rewrite_after_shards(monkeypatch, 1, corpus, "\n".join(text.upper() for text in long) + "\n")
    with pytest.raises(UserError, match=r"changed while it was read: .* up to document 4 differs") as raised:
        bert_cluster.embed(tiny_encoder, corpus, out, **TWO_A_SHARD)
    assert "the 1 shard(s) written before stay in" in str(raised.value) and "--overwrite" in str(raised.value)
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.parquet"]  # the old text's, whole
    assert not (out / "manifest.json").exists()
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"other settings: input.content_sha256"):  # the same command again
        bert_cluster.embed(tiny_encoder, corpus, out, **TWO_A_SHARD)
    assert read_documents(corpus).documents[0].text.startswith("ONE SMALL TEXT AND MORE WORDS")
    redone = bert_cluster.embed(tiny_encoder, corpus, out, overwrite=True, **TWO_A_SHARD)
    assert redone.resumed_shards == 0 and redone.documents == 6


def test_a_change_after_the_last_shard_is_caught_at_the_end_of_the_second_pass(
    tiny_encoder, tmp_path, monkeypatch
):
    corpus, out = _six(tmp_path), tmp_path / "out"
    _rewrite_after_shards(monkeypatch, 3, corpus, "\n".join(SIX) + "\n\nseven, added late\n")
    with pytest.raises(UserError, match=r"changed while it was read: .* up to document 7 differs"):
        bert_cluster.embed(tiny_encoder, corpus, out, **TWO_A_SHARD)
    assert len(list(out.glob("shard-*"))) == 3 and not (out / "manifest.json").exists()


def test_swapped_shards_are_embedded_again_not_resumed(tiny_encoder, tmp_path):
    """Issue 69: two finished shards swapped by name made read_output call shard 0 damaged, and the
    rerun it asked for resumed all of them and changed nothing: a loop."""
    corpus, out = _six(tmp_path), tmp_path / "out"
    bert_cluster.embed(tiny_encoder, corpus, out, **TWO_A_SHARD)
    ids, before = matrix(out)
    first, second = out / "shard-00000.parquet", out / "shard-00001.parquet"
    first.rename(out / "swap"), second.rename(first), (out / "swap").rename(second)
    with pytest.raises(UserError, match=r"shard shard-00000.parquet is damaged"):
        read_output(out)
    again = bert_cluster.embed(tiny_encoder, corpus, out, **TWO_A_SHARD)
    assert again.damaged_shards == {
        "shard-00000.parquet": "it holds other documents (ids '3' to '4') than this shard's (ids '1' to '2')",
        "shard-00001.parquet": "it holds other documents (ids '1' to '2') than this shard's (ids '3' to '4')",
    }
    assert again.resumed_shards == 1
    after_ids, after = matrix(out)
    assert after_ids == ids == ["1", "2", "3", "4", "5", "6"]
    assert np.array_equal(after.view(np.uint32), before.view(np.uint32))


def test_a_lone_surrogate_is_skipped_by_line_not_a_tokenizer_error_after_shards(tiny_encoder, tmp_path):
    corpus = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": text}) for text in SIX]
    lines.insert(4, '{"text": "\\ud800 x"}')
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    done = CliRunner().invoke(
        app, ["embed", str(tiny_encoder), str(corpus), "-o", str(tmp_path / "out"), "--exact", "-q"]
    )
    assert done.exit_code == 0, done.output
    assert done.stderr.strip().splitlines() == [
        "skipped 5 (line 5): not valid Unicode: a lone surrogate U+D800 at character 1, which no tokenizer "
        "takes"
    ]
    assert matrix(tmp_path / "out")[0] == ["1", "2", "3", "4", "6", "7"]


def test_a_record_without_an_id_is_reported_as_such(tiny_encoder, tmp_path):
    corpus = tmp_path / "d.jsonl"
    corpus.write_text('{"text": "no id here"}\n{"id": "1", "text": "the real one"}\n', encoding="utf-8")
    arguments = ["embed", str(tiny_encoder), str(corpus), "-o", str(tmp_path / "out"), "--exact", "-q"]
    done = CliRunner().invoke(app, [*arguments, "--id-field", "id"])
    assert done.exit_code == 0, done.output
    assert done.stderr.strip() == "skipped a record (line 1): no id (the id field is missing, null or empty)"
    assert matrix(tmp_path / "out")[0] == ["1"]


def test_an_output_in_the_model_folder_is_refused_overwrite_or_not(tiny_encoder, tmp_path):
    """An output inside the model's folder changed the model's files as it was written (and so its
    resume check); one that is the folder, or holds it, would mix with them."""
    corpus = _six(tmp_path)
    before = {p: p.read_bytes() for p in tiny_encoder.rglob("*") if p.is_file()}
    (tmp_path / "link").symlink_to(tiny_encoder)
    for out, where in [
        (tiny_encoder / "embeddings", "lies inside the model folder"),
        (tmp_path / "link" / "embeddings", "lies inside the model folder"),
        (tmp_path / "link", "is the model folder"),
        (tiny_encoder.parent, "holds the model folder"),
    ]:
        for overwrite in (False, True):
            with pytest.raises(UserError, match=where):
                bert_cluster.embed(tiny_encoder, corpus, out, overwrite=overwrite, **TWO_A_SHARD)
    assert not (tiny_encoder / "embeddings").exists()
    assert {p: p.read_bytes() for p in tiny_encoder.rglob("*") if p.is_file()} == before


def test_a_damaged_shard_s_reason_is_cut_at_a_word(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    long = "Parquet magic bytes not found in footer: either the file is corrupted or this is not " * 3
    monkeypatch.setattr(pq, "read_table", lambda path: (_ for _ in ()).throw(pa.ArrowInvalid(long)))
    with pytest.raises(store.DamagedShard) as raised:
        store.verify_shard(tmp_path / "shard-00000.parquet", "x")
    reason = str(raised.value).removeprefix("it cannot be read: ")
    assert reason.endswith(" ...") and long.startswith(reason.removesuffix(" ..."))
    assert long[len(reason.removesuffix(" ..."))] == " "  # the cut falls between words
