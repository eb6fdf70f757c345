"""The ASGI app in process (httpx's ASGITransport): shapes, errors, limits, key, metrics, offline equality."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_support import CLUSTERED, serving

import bert_cluster
from bert_cluster.config import ClusteredAttentionConfig
from bert_cluster.errors import UserError
from bert_cluster.serve import ServeSettings, create_app

pytestmark = pytest.mark.anyio

#: Batched against alone, the largest difference measured in an embedding's element (unit-length
#: vectors, 24 texts of 5 to ~480 tokens): 1.19e-07 exact and 0.0 clustered on the tiny model,
#: 1.19e-07 exact and 9.5e-08 clustered on all-MiniLM-L6-v2 (Zen 4, float32). The test allows 8x.
BATCHED_TOLERANCE = 1e-6
TEXTS = [f"the quick brown fox {i} " * (1 + (i * 7) % 23) for i in range(12)]


@pytest.fixture(scope="module")
def exact_app(tiny_encoder):
    return create_app(str(tiny_encoder), exact=True, warmup=False)


def offline(model, texts: list[str], attention: dict | None, batch_size: int = 1) -> np.ndarray:
    """``SentenceTransformer.encode`` with the server's truncation and settings (alone by default)."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(model), device="cpu")
    encoder.max_seq_length = 512
    if attention is not None:
        bert_cluster.convert(encoder, **attention)
    return encoder.encode(texts, batch_size=batch_size)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def test_the_openai_answer_has_openai_shape_order_usage_and_model(exact_app, tiny_encoder):
    from openai.types import CreateEmbeddingResponse

    async with serving(exact_app) as client:
        answer = await client.post("/v1/embeddings", json={"input": TEXTS[:5], "model": "whatever"})
        assert answer.status_code == 200, answer.text
        parsed = CreateEmbeddingResponse.model_validate(answer.json(), strict=True)
        counted = exact_app.state.server.runner.count_tokens(TEXTS[:5])
    assert [item.index for item in parsed.data] == [0, 1, 2, 3, 4]
    assert parsed.model == "tiny-st" and parsed.object == "list"
    assert parsed.usage.prompt_tokens == parsed.usage.total_tokens == sum(counted)
    served = np.array([item.embedding for item in parsed.data], dtype=np.float32)
    np.testing.assert_allclose(served, offline(tiny_encoder, TEXTS[:5], None), atol=BATCHED_TOLERANCE, rtol=0)


async def test_the_openai_client_reads_float_and_base64_answers(exact_app):
    import httpx
    from openai import AsyncOpenAI

    async with serving(exact_app):
        transport = httpx.ASGITransport(app=exact_app)
        async with httpx.AsyncClient(transport=transport) as http:
            client = AsyncOpenAI(api_key="unused", base_url="http://serve.test/v1", http_client=http)
            as_float = await client.embeddings.create(
                model="tiny-st", input=TEXTS[:3], encoding_format="float"
            )
            # No format given: the client asks for base64 and decodes it itself.
            as_base64 = await client.embeddings.create(model="tiny-st", input=TEXTS[:3])
    np.testing.assert_array_equal(
        np.array([d.embedding for d in as_float.data], dtype=np.float32),
        np.array([d.embedding for d in as_base64.data], dtype=np.float32),
    )


async def test_base64_is_little_endian_float32(exact_app):
    async with serving(exact_app) as client:
        floats = (await client.post("/v1/embeddings", json={"input": "a text"})).json()
        packed = (
            await client.post("/v1/embeddings", json={"input": "a text", "encoding_format": "base64"})
        ).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


async def test_one_input_equals_offline_encode_bit_for_bit_in_exact_mode(exact_app, tiny_encoder):
    text = "the same numbers as offline, to the last bit"
    async with serving(exact_app) as client:
        openai = (await client.post("/v1/embeddings", json={"input": text})).json()
        tei = (await client.post("/embed", json={"inputs": text})).json()
    expected = offline(tiny_encoder, [text], None)[0]
    np.testing.assert_array_equal(np.array(openai["data"][0]["embedding"], dtype=np.float32), expected)
    np.testing.assert_array_equal(np.array(tei[0], dtype=np.float32), expected)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "clustered"])
async def test_concurrent_requests_equal_offline_within_the_batched_tolerance(tiny_encoder, exact):
    attention = None if exact else CLUSTERED
    config = None if exact else ClusteredAttentionConfig.for_convert(**CLUSTERED)
    app = create_app(str(tiny_encoder), exact=exact, attention=config, warmup=False, max_wait_ms=20)
    async with serving(app) as client:
        answers = await asyncio.gather(*(client.post("/embed", json={"inputs": text}) for text in TEXTS))
        batches = metric((await client.get("/metrics")).text, "bert_cluster_serve_batch_inputs_count")
    served = np.array([answer.json()[0] for answer in answers], dtype=np.float32)
    assert batches < len(TEXTS)  # some inputs did share a batch
    np.testing.assert_allclose(
        served, offline(tiny_encoder, TEXTS, attention), atol=BATCHED_TOLERANCE, rtol=0
    )


async def test_tei_normalize_and_truncate(tiny_encoder):
    unnormalised = tiny_encoder.parent / "plain-st"
    import helpers

    helpers.save_sentence_transformer(unnormalised, normalize=False, max_seq_length=512)
    app = create_app(str(unnormalised), exact=True, warmup=False, max_input_tokens=32)
    long_text = "word " * 40
    async with serving(app) as client:
        scaled = (await client.post("/embed", json={"inputs": "a text"})).json()[0]
        raw = (await client.post("/embed", json={"inputs": "a text", "normalize": False})).json()[0]
        refused = await client.post("/embed", json={"inputs": long_text})
        cut = await client.post("/embed", json={"inputs": long_text, "truncate": True})
        cut_openai = (await client.post("/v1/embeddings", json={"input": long_text, "truncate": True})).json()
    assert abs(np.linalg.norm(scaled) - 1) < 1e-6 and abs(np.linalg.norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(np.array(scaled), np.array(raw) / np.linalg.norm(raw), rtol=1e-6)
    assert refused.status_code == 413
    assert "at most 32 are allowed (max_input_tokens)" in refused.json()["error"]["message"]
    assert cut.status_code == 200 and cut_openai["usage"]["prompt_tokens"] == 32


BAD_INPUTS = [
    ("malformed JSON", b'{"input": ', 422, "the body is not valid JSON"),
    ("mistyped input", b'{"input": 3}', 422, "input must be a string or a list of strings (got a number)"),
    ("a number in the list", b'{"input": ["a", 3]}', 422, "(position 1 is a number)"),
    ("no input", b'{"model": "m"}', 422, "input: Field required"),
    ("an unknown field", b'{"input": "a", "inputz": 1}', 422, "inputz: Extra inputs are not permitted"),
    ("an empty list", b'{"input": []}', 422, "input is an empty list"),
    ("an empty text", b'{"input": ["a", ""]}', 422, "an empty text at position 1"),
    ("not an object", b"[1, 2]", 422, "the body must be a JSON object"),
    ("non-UTF-8", '{"input": "caf\xe9"}'.encode("latin-1"), 422, "not valid UTF-8"),
    ("a bad format", b'{"input": "a", "encoding_format": "int8"}', 422, "encoding_format: Input should be"),
    (
        "a string for a bool",
        b'{"input": "a", "truncate": "yes"}',
        422,
        "truncate: Input should be a valid boolean",
    ),
    ("other dimensions", b'{"input": "a", "dimensions": 7}', 422, "this model gives 32 dimensions only"),
    ("too many inputs", json.dumps({"input": ["a"] * 5}).encode(), 413, "at most 4 are allowed per request"),
    ("too many tokens", json.dumps({"input": "word " * 200}).encode(), 413, "at most 64 are allowed"),
    (
        "a body too large",
        json.dumps({"input": "a" * 3000}).encode(),
        413,
        "larger than the 2000 bytes allowed",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "message"), [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
async def test_every_bad_input_gets_its_status_and_a_message(tiny_encoder, body, status, message):
    app = create_app(
        str(tiny_encoder),
        exact=True,
        warmup=False,
        max_client_batch_size=4,
        max_input_tokens=64,
        payload_limit=2000,
    )
    async with serving(app) as client:
        answer = await client.post(
            "/v1/embeddings", content=body, headers={"content-type": "application/json"}
        )
        after = await client.post("/v1/embeddings", json={"input": "still serving"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert set(error) == {"message", "type", "param", "code"}
    assert after.status_code == 200


async def test_a_streamed_body_past_the_payload_limit_is_refused_too(tiny_encoder):
    app = create_app(str(tiny_encoder), exact=True, warmup=False, payload_limit=2000)

    async def chunks():
        for _ in range(4):
            yield b" " * 600  # no declared length: counted as it arrives

    async with serving(app) as client:
        answer = await client.post(
            "/v1/embeddings", content=chunks(), headers={"content-type": "application/json"}
        )
    assert answer.status_code == 413
    assert "larger than the 2000 bytes allowed (payload_limit)" in answer.json()["error"]["message"]


async def test_unknown_routes_and_methods_answer_in_the_same_shape(exact_app):
    async with serving(exact_app) as client:
        missing = await client.get("/v2/nothing")
        wrong_method = await client.get("/v1/embeddings")
    assert missing.status_code == 404 and "no route /v2/nothing" in missing.json()["error"]["message"]
    assert wrong_method.status_code == 405 and "GET is not allowed" in wrong_method.json()["error"]["message"]


async def test_the_api_key_is_enforced_except_on_the_probes(tiny_encoder):
    app = create_app(str(tiny_encoder), exact=True, warmup=False, api_key="s3cret")
    async with serving(app) as client:
        missing = await client.post("/v1/embeddings", json={"input": "a"})
        wrong = await client.post("/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cre"})
        basic = await client.get("/info", headers={"Authorization": "Basic s3cret"})
        right = await client.post(
            "/v1/embeddings", json={"input": "a"}, headers={"Authorization": "Bearer s3cret"}
        )
        metrics = await client.get("/metrics")
        probes = [(await client.get(path)).status_code for path in ("/health", "/ready")]
    for refused in (missing, wrong, basic, metrics):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in refused.json()["error"]["message"]
    assert right.status_code == 200 and probes == [200, 200]


def hold_the_model(app, monkeypatch) -> threading.Event:
    """Batches wait for the returned gate before they run (requests stay in flight meanwhile)."""
    runner = app.state.server.runner
    gate = threading.Event()
    embed = runner.embed

    def held(texts):
        gate.wait(30)
        return embed(texts)

    monkeypatch.setattr(runner, "embed", held)
    return gate


async def test_overload_answers_429_with_retry_after_and_recovers(tiny_encoder, monkeypatch):
    app = create_app(str(tiny_encoder), exact=True, warmup=False, max_concurrent_requests=2)
    state = app.state.server
    gate = hold_the_model(app, monkeypatch)
    async with serving(app) as client:
        first = [asyncio.ensure_future(client.post("/embed", json={"inputs": f"t{i}"})) for i in range(2)]
        while state.in_flight < 2:
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/embeddings", json={"input": "one too many"})
        gate.set()
        done = await asyncio.gather(*first)
        after = await client.post("/v1/embeddings", json={"input": "after the rush"})
        counted = metric(
            (await client.get("/metrics")).text, "bert_cluster_serve_requests_total", status="429"
        )
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert "limit of 2 concurrent requests" in refused.json()["error"]["message"]
    assert [answer.status_code for answer in done] == [200, 200] and after.status_code == 200
    assert counted == 1


async def test_a_cancelled_request_does_not_wedge_the_batcher(tiny_encoder, monkeypatch):
    app = create_app(str(tiny_encoder), exact=True, warmup=False)
    state = app.state.server
    gate = hold_the_model(app, monkeypatch)
    async with serving(app) as client:
        running = asyncio.ensure_future(client.post("/embed", json={"inputs": "first"}))
        while not state.batcher.busy:
            await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(client.post("/embed", json={"inputs": "gone"}))
        while state.batcher.queued_inputs < 1:
            await asyncio.sleep(0.01)
        gone.cancel()  # the client goes away while its input waits
        await asyncio.gather(gone, return_exceptions=True)
        assert state.batcher.queued_inputs == 0 and state.in_flight == 1
        gate.set()
        assert (await running).status_code == 200
        assert (await client.post("/embed", json={"inputs": "next"})).status_code == 200
        assert state.in_flight == 0


async def test_metrics_count_the_requests_sent(exact_app):
    async with serving(exact_app) as client:
        before = (await client.get("/metrics")).text
        for i in range(7):
            await client.post("/v1/embeddings", json={"input": [f"text {i}", "and another"]})
        for i in range(3):
            await client.post("/embed", json={"inputs": f"tei {i}"})
        await client.post("/embed", json={"inputs": []})
        usage = (await client.post("/v1/embeddings", json={"input": "counted"})).json()["usage"][
            "prompt_tokens"
        ]
        after = (await client.get("/metrics")).text

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("bert_cluster_serve_requests_total", route="/v1/embeddings", status="200") == 8
    assert grew("bert_cluster_serve_requests_total", route="/embed", status="200") == 3
    assert grew("bert_cluster_serve_requests_total", route="/embed", status="422") == 1
    assert grew("bert_cluster_serve_inputs_total") == 7 * 2 + 3 + 1
    assert grew("bert_cluster_serve_request_seconds_count", route="/v1/embeddings") == 8
    assert grew("bert_cluster_serve_tokens_total") >= usage > 0
    assert "bert_cluster_serve_queue_inputs" in after and "bert_cluster_serve_batch_tokens_bucket" in after


async def test_ready_waits_for_the_warm_up_which_measures_min_length_auto(tiny_encoder, monkeypatch):
    app = create_app(str(tiny_encoder), attention=ClusteredAttentionConfig.for_convert(clusters=4, topk=8))
    runner = app.state.server.runner
    gate = threading.Event()
    warm_up = runner.warm_up
    monkeypatch.setattr(runner, "warm_up", lambda: (gate.wait(60), warm_up())[1])
    async with serving(app, ready=False) as client:
        assert (await client.get("/health")).status_code == 200
        waiting = await client.get("/ready")
        gate.set()
        for _ in range(1200):
            if (await client.get("/ready")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        info = (await client.get("/info")).json()
    assert waiting.status_code == 503 and "warming up" in waiting.json()["error"]["message"]
    assert info["ready"] is True and info["attention"]["min_length"] == "auto"
    measured = info["warmup"]["min_length"]
    assert measured and all(entry["min_length"] >= 0 for entry in measured)
    assert info["limits"]["max_input_tokens"] == 512 and info["limits"]["max_batch_tokens"] == 16384
    assert info["versions"]["bert-cluster"] == bert_cluster.__version__ and info["api_key"] is False


async def test_cors_is_off_unless_asked(tiny_encoder, exact_app):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    async with serving(exact_app) as client:
        closed = await client.options("/v1/embeddings", headers=preflight)
    app = create_app(str(tiny_encoder), exact=True, warmup=False, cors_origins=["https://app.example"])
    async with serving(app) as client:
        opened = await client.options("/v1/embeddings", headers=preflight)
    assert "access-control-allow-origin" not in closed.headers
    assert opened.headers["access-control-allow-origin"] == "https://app.example"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_batch_tokens": 100}, "max_batch_tokens 100 is below max_input_tokens 512"),
        ({"max_input_tokens": 600}, "max_input_tokens 600 is more than the model's 512 positions"),
        ({"exact": True, "attention": ClusteredAttentionConfig()}, "give no attention settings"),
        ({"dtype": "float16"}, "dtype must be one of float32, bfloat16"),
        ({"max_wait_ms": -1}, "max_wait_ms must be a number of milliseconds >= 0"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests must be >= 1"),
    ],
)
def test_contradictory_or_bad_settings_are_refused_before_loading(tiny_encoder, settings, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        create_app(str(tiny_encoder), **settings)


def test_settings_round_trip_through_json_with_the_key():
    settings = ServeSettings(
        "m", attention=ClusteredAttentionConfig(clusters=9), api_key="k", cors_origins=("https://a",)
    )
    data = json.loads(json.dumps(settings.to_dict(secrets=True)))
    assert ServeSettings.from_dict(data) == settings
    assert settings.to_dict()["api_key"] is True


async def until(condition, seconds: float = 30.0) -> None:
    """Wait for ``condition()`` (bounded: a test fails rather than hangs)."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still not true after {seconds} s: {condition}")


@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "no-interleave"])
async def test_a_query_behind_a_long_document_runs_between_its_layers_with_offline_numbers(
    tiny_encoder, interleave
):
    app = create_app(str(tiny_encoder), exact=True, warmup=False, interleave=interleave)
    state = app.state.server
    long_text, short_text = "a long document " * 60, "a query"  # 512 tokens (truncated) and 9
    assert state.runner.count_tokens([short_text])[0] * 4 <= 512
    hold = threading.Event()
    first_layer = bert_cluster.hf.attention_modules(state.runner.encoder.model)[0]

    def held(_module, args):  # the long document's pass waits in layer 0, before the batcher's hook
        if args[0].shape[1] > 100:
            hold.wait(30)

    first_layer.register_forward_pre_hook(held, prepend=True)
    async with serving(app) as client:
        long = asyncio.ensure_future(client.post("/embed", json={"inputs": long_text, "truncate": True}))
        await until(lambda: state.batcher.busy)
        short = asyncio.ensure_future(client.post("/embed", json={"inputs": short_text}))
        await until(lambda: state.batcher.queued_inputs == 1)
        hold.set()
        answers = await asyncio.gather(long, short)
        metrics = (await client.get("/metrics")).text
        between = metric(metrics, "bert_cluster_serve_batches_between_layers_total")
        info = (await client.get("/info")).json()
    assert [answer.status_code for answer in answers] == [200, 200], answers[0].text
    assert info["batching"] == {"interleave": interleave, "layers_hooked": 2}
    assert between == (1 if interleave else 0)
    served = np.array([answer.json()[0] for answer in answers], dtype=np.float32)
    expected = offline(tiny_encoder, [long_text, short_text], None)
    np.testing.assert_array_equal(served, expected)  # each alone in its pass: bit for bit
