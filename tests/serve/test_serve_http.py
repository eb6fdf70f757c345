"""``bert-cluster serve`` over real HTTP: uvicorn in a subprocess on a free loopback port.

Load, a graceful stop under load, a client that disconnects, overload, workers, start-up refusals. A
server's start is most of a test's time (imports and the model: 12 s at a load of 5 on 2 cores), so the
tests that do not stop a server share one, and every server the selected tests use starts at once (their
imports overlap). The shared server's counters add up over the tests: each reads what its own requests
added.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from serve_support import Server
from test_serve_app import BATCHED_TOLERANCE, metric, offline

pytestmark = pytest.mark.anyio

#: The shared server's requests in flight at most: above the 32 the load test keeps in flight.
SHARED_LIMIT = 34
#: Each server, by the fixture that hands it over. The shared one: a batch holds at most 512 padded tokens,
#: so while the load test keeps 32 requests in flight (inputs of 16 to 174 tokens) what is queued never fits
#: one batch and batches run without waiting; a lone input, or the overload test's 34 short ones (8 tokens
#: each), fits one and waits 2 s for company: time for a client to give up, or for the server to fill up.
SERVERS = {
    "shared_server": [
        "--exact",
        "--max-batch-tokens",
        "512",
        "--max-wait-ms",
        "2000",
        "--max-concurrent-requests",
        str(SHARED_LIMIT),
    ],
    # Inputs wait up to 2 s for company: they are in flight when the signal comes.
    "stopping_server": ["--exact", "--max-wait-ms", "2000", "--grace-s", "30"],
    "two_workers": ["--exact", "--workers", "2", "--threads", "2"],
}


@pytest.fixture(scope="module")
def launched(request, tiny_encoder, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """The servers of ``SERVERS`` that this module's selected tests use, all started (not yet ready)."""
    used = {
        name
        for item in request.session.items
        if item.module is request.module
        for name in item.fixturenames
        if name in SERVERS
    }
    folder = tmp_path_factory.mktemp("servers")
    servers = {name: Server(tiny_encoder, SERVERS[name], folder / f"{name}.log") for name in sorted(used)}
    yield servers
    for server in servers.values():
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(10)


@pytest.fixture(scope="module")
def servers(launched) -> dict[str, Server]:
    """Every launched server, ready: no test's timing runs beside another server's start.

    Waiting for them is most of the suite's time (27 s at a load of 8 on 2 cores, after the 41 s of the
    first test beside them): 6 processes import torch, transformers and the app, the two workers' too.
    """
    for server in launched.values():
        server.wait_ready()
    return launched


@pytest.fixture(scope="module")
def shared_server(servers) -> Iterator[Server]:
    """The server the tests that do not stop one share; it stops cleanly (exit 0) after the last of them."""
    server = servers["shared_server"]
    yield server
    assert server.stop() == 0


@pytest.fixture
def stopping_server(servers) -> Server:
    return servers["stopping_server"]


@pytest.fixture
def two_workers(servers) -> Server:
    return servers["two_workers"]


# The module's first test: the servers start beside it, so its time (7 s alone at a load of 5 on 2 cores,
# 41 s beside the servers' start at a load of 8) is mostly theirs.
@pytest.mark.usefixtures("launched")
@pytest.mark.slow(
    reason="starts the module's shared servers beside its refused one (each imports torch and transformers)"
)
def test_a_contradictory_start_is_refused_with_one_line_and_exit_2(tiny_encoder):
    result = subprocess.run(
        [sys.executable, "-m", "bert_cluster", "serve", str(tiny_encoder), "--max-batch-tokens", "100"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: max_batch_tokens 100 is below max_input_tokens 512")


def wait_for_metric(url: str, name: str, value: float, timeout: float = 30, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while True:
        seen = metric(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)
        if seen == value or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


# 1,000 requests through HTTP and JSON, and their 1,999 inputs encoded offline: 21 s at a load of 8 on 2
# cores.
@pytest.mark.slow(
    reason="1,000 requests over HTTP to a uvicorn subprocess, each answer checked against the offline path"
)
async def test_1000_requests_at_concurrency_32_lose_nothing_and_answer_their_own_input(
    tiny_encoder, shared_server
):
    server = shared_server
    before = httpx.get(f"{server.url}/metrics").text
    # Every tenth request one input cut at the model's 512 positions, the others 16 to 174 tokens: queries
    # run between the long inputs' layers (the tiny model's 2), as interleaving does by default.
    requests = [
        [f"request {r} part {p}: " + "word " * ((r * 13 + p * 7) % 40) for p in range(1 + r % 3)]
        if r % 10
        else [f"request {r} part 0: " + "word " * 200]
        for r in range(1000)
    ]
    limit = asyncio.Semaphore(32)
    answers: dict[int, httpx.Response] = {}

    async def send(client: httpx.AsyncClient, number: int) -> None:
        async with limit:
            body = {"input": requests[number], "truncate": True}
            answers[number] = await client.post("/v1/embeddings", json=body)

    connections = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=server.url, limits=connections, timeout=120) as client:
        await asyncio.wait_for(asyncio.gather(*(send(client, number) for number in range(1000))), 600)
    assert sorted(answers) == list(range(1000))
    assert {answer.status_code for answer in answers.values()} == {200}
    texts = [text for request in requests for text in request]
    # Batched offline too (as differently as the server batches them): within the same tolerance.
    expected = dict(zip(texts, offline(tiny_encoder, texts, None, batch_size=64), strict=True))
    for number, answer in answers.items():
        data = answer.json()["data"]
        assert [item["index"] for item in data] == list(range(len(requests[number])))
        served = np.array([item["embedding"] for item in data], dtype=np.float32)
        wanted = np.stack([expected[text] for text in requests[number]])
        np.testing.assert_allclose(served, wanted, atol=BATCHED_TOLERANCE, rtol=0)
    after = httpx.get(f"{server.url}/metrics").text

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew("bert_cluster_serve_inputs_total") == len(texts)
    assert grew("bert_cluster_serve_batch_inputs_count") < len(texts)  # batched
    assert grew("bert_cluster_serve_batches_between_layers_total") > 0  # and interleaved


async def test_sigterm_under_load_finishes_in_flight_work_refuses_new_work_and_exits_0(stopping_server):
    server = stopping_server

    async def one(number: int) -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await client.post("/embed", json={"inputs": f"in flight {number}"})

    in_flight = [asyncio.ensure_future(one(number)) for number in range(10)]
    seen = await asyncio.to_thread(
        wait_for_metric, server.url, "bert_cluster_serve_requests_in_flight", 10, 30
    )
    assert seen == 10
    server.process.send_signal(15)
    refused = None
    for _ in range(100):
        try:
            httpx.get(f"{server.url}/health", timeout=1)
        # New work refused: the socket closed (ConnectError), or a connection that reached the backlog as
        # it closed is dropped unanswered (RemoteProtocolError: seen in a whole-suite run on 2 busy cores).
        except (httpx.ConnectError, httpx.RemoteProtocolError) as error:
            refused = error
            break
        time.sleep(0.02)
    answers = await asyncio.gather(*in_flight)
    assert refused is not None, "new connections were still accepted after SIGTERM"
    assert [answer.status_code for answer in answers] == [200] * 10
    assert server.process.wait(60) == 0
    assert "Application shutdown complete" in server.log.read_text()


async def test_a_disconnecting_client_and_overload_over_http(shared_server):
    server = shared_server
    url = server.url
    before = httpx.get(f"{url}/metrics").text
    gone_before = metric(before, "bert_cluster_serve_requests_total", status="499")
    # A client that gives up while its input waits for company: the input leaves the queue (499).
    async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/embed", json={"inputs": "nobody waits for me"})
    gone = await asyncio.to_thread(
        wait_for_metric, url, "bert_cluster_serve_requests_total", gone_before + 1, 30, status="499"
    )
    assert gone == gone_before + 1
    # SHARED_LIMIT requests fill the server (each waits 2 s for company); the next two are answered 429 at
    # once.
    connections = httpx.Limits(max_connections=SHARED_LIMIT + 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=connections) as client:
        first = [
            asyncio.ensure_future(client.post("/embed", json={"inputs": f"kept {i}"}))
            for i in range(SHARED_LIMIT)
        ]
        full = await asyncio.to_thread(
            wait_for_metric, url, "bert_cluster_serve_requests_in_flight", SHARED_LIMIT, 30
        )
        refused = [await client.post("/embed", json={"inputs": f"refused {i}"}) for i in range(2)]
        kept = await asyncio.gather(*first)
        after = await client.post("/embed", json={"inputs": "after the rush"})
    assert full == SHARED_LIMIT
    assert [answer.status_code for answer in refused] == [429, 429]
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in refused)
    assert [answer.status_code for answer in kept] == [200] * SHARED_LIMIT and after.status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    inputs = "bert_cluster_serve_inputs_total"
    assert metric(metrics, inputs) - metric(before, inputs) == SHARED_LIMIT + 1  # the abandoned one never ran
    assert metric(metrics, "bert_cluster_serve_queue_inputs") == 0


@pytest.mark.slow
async def test_two_workers_split_the_threads_and_answer_metrics_for_both(two_workers):
    server = two_workers
    info = httpx.get(f"{server.url}/info", timeout=30).json()

    async def one(number: int) -> httpx.Response:
        # A connection each: the kernel spreads them over the two processes.
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await client.post("/embed", json={"inputs": f"t{number}"})

    answers = await asyncio.gather(*(one(number) for number in range(20)))
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert info["workers"] == 2 and info["threads"] == 1
    assert [answer.status_code for answer in answers] == [200] * 20
    assert metric(metrics, "bert_cluster_serve_requests_total", route="/embed", status="200") == 20
    assert server.stop() == 0
