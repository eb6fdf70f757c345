"""``bert-cluster serve`` over real HTTP: uvicorn in a subprocess on a free loopback port.

Load, a graceful stop under load, a client that disconnects, overload, workers, start-up refusals.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from test_serve_app import BATCHED_TOLERANCE, metric, offline

pytestmark = pytest.mark.anyio


def wait_for_metric(url: str, name: str, value: float, timeout: float = 30, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while True:
        seen = metric(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)
        if seen == value or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


async def test_1000_requests_at_concurrency_32_lose_nothing_and_answer_their_own_input(
    tiny_encoder, start_server
):
    server = start_server(tiny_encoder, "--exact", "--max-wait-ms", "5")
    requests = [
        [f"request {r} part {p}: " + "word " * ((r * 13 + p * 7) % 40) for p in range(1 + r % 3)]
        for r in range(1000)
    ]
    limit = asyncio.Semaphore(32)
    answers: dict[int, httpx.Response] = {}

    async def send(client: httpx.AsyncClient, number: int) -> None:
        async with limit:
            answers[number] = await client.post("/v1/embeddings", json={"input": requests[number]})

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
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, "bert_cluster_serve_inputs_total") == len(texts)
    assert metric(metrics, "bert_cluster_serve_batch_inputs_count") < len(texts)  # batched
    assert server.stop() == 0


async def test_sigterm_under_load_finishes_in_flight_work_refuses_new_work_and_exits_0(
    tiny_encoder, start_server
):
    # Inputs wait up to 2 s for company: they are in flight when the signal comes.
    server = start_server(tiny_encoder, "--exact", "--max-wait-ms", "2000", "--grace-s", "30")

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
        except httpx.ConnectError as error:
            refused = error
            break
        time.sleep(0.02)
    answers = await asyncio.gather(*in_flight)
    assert refused is not None, "new connections were still accepted after SIGTERM"
    assert [answer.status_code for answer in answers] == [200] * 10
    assert server.process.wait(60) == 0
    assert "Application shutdown complete" in server.log.read_text()


async def test_a_disconnecting_client_and_overload_over_http(tiny_encoder, start_server):
    server = start_server(tiny_encoder, "--exact", "--max-wait-ms", "1500", "--max-concurrent-requests", "2")
    # A client that gives up while its input waits for company: the input leaves the queue (499).
    async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/embed", json={"inputs": "nobody waits for me"})
    gone = await asyncio.to_thread(
        wait_for_metric, server.url, "bert_cluster_serve_requests_total", 1, 30, status="499"
    )
    assert gone == 1
    # Two requests fill the server (each waits 1.5 s); the third and fourth are answered 429 at once.
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        first = [asyncio.ensure_future(client.post("/embed", json={"inputs": f"kept {i}"})) for i in range(2)]
        await asyncio.to_thread(wait_for_metric, server.url, "bert_cluster_serve_requests_in_flight", 2, 30)
        refused = [await client.post("/embed", json={"inputs": f"refused {i}"}) for i in range(2)]
        kept = await asyncio.gather(*first)
        after = await client.post("/embed", json={"inputs": "after the rush"})
    assert [answer.status_code for answer in refused] == [429, 429]
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in refused)
    assert [answer.status_code for answer in kept] == [200, 200] and after.status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, "bert_cluster_serve_inputs_total") == 3  # the abandoned input never ran
    assert metric(metrics, "bert_cluster_serve_queue_inputs") == 0
    assert server.stop() == 0


@pytest.mark.slow
async def test_two_workers_split_the_threads_and_answer_metrics_for_both(tiny_encoder, start_server):
    server = start_server(tiny_encoder, "--exact", "--workers", "2", "--threads", "2")
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
