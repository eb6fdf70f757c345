"""Fixtures of the server tests: a tiny SentenceTransformer, the app in process, a uvicorn subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import helpers
import httpx
import pytest

#: Settings that make the clustered path run on every row the tests send (no per-machine crossover).
CLUSTERED = {"clusters": 4, "topk": 8, "min_length": 0}
#: Seconds a subprocess server gets to start and warm up (loaded CPU: imports take most of it).
START_S = 180


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> Path:
    """A SentenceTransformer around a random 2-layer BERT (512 positions, mean pooling, normalised)."""
    return helpers.save_sentence_transformer(tmp_path_factory.mktemp("serve") / "tiny-st", max_seq_length=512)


@contextlib.asynccontextmanager
async def serving(app, ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The app started (its lifespan) and a client talking to it in process; ready first if asked."""
    import asyncio

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve.test", timeout=60) as client:
            if ready:
                for _ in range(600):
                    if (await client.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the app never became ready")
            yield client


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """``bert-cluster serve`` in a subprocess on a free loopback port; its log in a file."""

    def __init__(self, model: Path, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # One torch thread: on a machine shared with other work, two threads wait on each other's
        # descheduling at every op (10x slower on the tiny model under a load of 8 on 2 cores).
        command = [sys.executable, "-m", "bert_cluster", "serve", str(model), "--port", str(self.port)]
        command += ["--threads", "1", *args] if "--threads" not in args else args
        environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the server exited {self.process.returncode}: {self.log.read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready in {START_S} s: {self.log.read_text()[-3000:]}")

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(f"the server did not stop within {timeout} s") from None
