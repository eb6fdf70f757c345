"""``bert-cluster serve``'s shell: options into ``ServeSettings`` (the API patched), refusals in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from bert_cluster import serve
from bert_cluster.cli import app
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.serve import ServeSettings
from bert_cluster.serve.server import split_threads

runner = CliRunner()


@pytest.fixture
def calls(monkeypatch) -> list:
    recorded = []
    monkeypatch.setattr(serve, "run_server", lambda settings, **options: recorded.append((settings, options)))
    return recorded


def test_options_become_the_settings_the_api_takes(calls):
    result = runner.invoke(
        app,
        [
            "serve", "some/model", "--clusters", "10", "--topk", "16", "--min-length", "256", "--dtype",
            "bfloat16", "--threads", "4", "--workers", "2", "--host", "0.0.0.0", "--port", "9000",
            "--max-input-tokens", "2048", "--max-batch-tokens", "8192", "--max-batch-requests", "16",
            "--max-wait-ms", "3.5", "--max-client-batch-size", "8", "--max-concurrent-requests", "100",
            "--payload-limit", "5000", "--api-key", "k", "--cors-origin", "https://a", "--cors-origin",
            "https://b", "--grace-s", "7", "--no-warmup", "--model-name", "mini",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    settings, options = calls[0]
    assert settings == ServeSettings(
        model="some/model",
        attention=ClusteredAttentionConfig.for_convert(clusters=10, topk=16, min_length=256),
        dtype="bfloat16",
        threads=4,
        model_name="mini",
        max_input_tokens=2048,
        max_batch_tokens=8192,
        max_batch_requests=16,
        max_wait_ms=3.5,
        max_client_batch_size=8,
        max_concurrent_requests=100,
        payload_limit=5000,
        api_key="k",
        cors_origins=("https://a", "https://b"),
        warmup=False,
    )
    assert options == {"host": "0.0.0.0", "port": 9000, "workers": 2, "grace_s": 7.0, "log_level": "info"}


def test_defaults_are_the_settings_defaults_and_convert_s_preset(calls, monkeypatch):
    monkeypatch.setenv("BERT_CLUSTER_API_KEY", "from-the-environment")
    result = runner.invoke(app, ["serve", "some/model"])
    assert result.exit_code == 0, result.output
    settings, options = calls[0]
    assert settings == ServeSettings(
        "some/model", attention=ClusteredAttentionConfig.for_convert(), api_key="from-the-environment"
    )
    assert options["host"] == "127.0.0.1" and options["workers"] == 1
    assert runner.invoke(app, ["serve", "m", "--exact"]).exit_code == 0
    assert calls[-1][0].exact and calls[-1][0].config is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--exact", "--clusters", "5"], "error: --exact serves the unmodified model: drop --clusters"),
        (["--exact", "--topk", "5"], "error: --exact serves the unmodified model: drop --topk"),
        (["--dtype", "float16"], "error: dtype must be one of float32, bfloat16, got 'float16'"),
        (["--max-wait-ms", "-1"], "error: max_wait_ms must be a number of milliseconds >= 0"),
        (["--max-client-batch-size", "0"], "error: max_client_batch_size must be >= 1, got 0"),
        (["--clusters", "5,10"], "error: --clusters: this command takes one cluster count C"),
    ],
)
def test_bad_options_are_refused_in_one_line_with_exit_2(calls, arguments, message):
    result = runner.invoke(app, ["serve", "some/model", *arguments])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [message] or result.output.strip().startswith(message)
    assert len(result.output.strip().splitlines()) == 1 and not calls


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--workers", "0"], "error: workers must be a positive int, got 0"),
        (["--max-batch-tokens", "100"], "error: max_batch_tokens 100 is below max_input_tokens 512"),
        (["--max-input-tokens", "513"], "error: max_input_tokens 513 is more than the model's 512 positions"),
    ],
)
def test_refusals_that_need_the_model_s_config(tiny_encoder, arguments, message):
    result = runner.invoke(app, ["serve", str(tiny_encoder), *arguments])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output


def test_threads_are_split_between_workers():
    assert split_threads(8, 2) == 4 and split_threads(3, 2) == 1 and split_threads(1, 4) == 1
