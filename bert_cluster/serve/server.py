"""Running the app on uvicorn: one process, or ``workers`` processes sharing the port and the threads.

Stopping: on SIGTERM or SIGINT uvicorn closes the listening socket (new connections are refused), lets
the requests in flight finish for up to ``grace_s`` seconds, then stops the app (its lifespan stops the
batcher). uvicorn then raises the signal again on its process, which would end it with the signal's
status; ``run_server`` takes that signal itself, so that a stop asked for exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from bert_cluster.errors import UserError
from bert_cluster.serve.settings import ServeSettings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def split_threads(threads: int | None, workers: int) -> int:
    """Torch threads per worker: ``threads`` (default: torch's, one per core) split evenly, at least 1."""
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return max(1, threads // workers)


@contextlib.contextmanager
def _stop_is_success() -> Iterator[None]:
    """While uvicorn runs: its re-raised stop signal lands here and the process goes on to exit 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8080,
    workers: int = 1,
    grace_s: float = 30.0,
    log_level: str = "info",
) -> None:
    """Serve ``settings`` on ``host:port`` until SIGTERM or SIGINT (then return: a clean stop).

    ``settings.threads`` is the total: each of ``workers`` processes gets its share. The settings are
    checked (and the model loaded, with one worker) before the port is bound.

    Raises:
        UserError: bad settings or a model that cannot be loaded.
    """
    import uvicorn

    from bert_cluster.serve.app import SETTINGS_ENV, check_settings, create_app

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"workers must be a positive int, got {workers!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise UserError(f"port must be in 0..65535 (0: any free port), got {port!r}")
    if not grace_s >= 0:
        raise UserError(f"grace_s must be a number of seconds >= 0, got {grace_s}")
    settings = check_settings(settings)
    per_worker = ServeSettings.from_dict(
        {**settings.to_dict(secrets=True), "threads": split_threads(settings.threads, workers)}
    )
    common: dict[str, Any] = {
        "host": host,
        "port": port,
        "timeout_graceful_shutdown": grace_s,
        "log_level": log_level,
        "server_header": False,
    }
    if workers == 1:
        app = create_app(per_worker)
        with _stop_is_success():
            uvicorn.run(app, **common)
        return
    with (
        tempfile.TemporaryDirectory(prefix="bert-cluster-metrics-") as metrics_dir,
        _environment(
            {
                SETTINGS_ENV: json.dumps(per_worker.to_dict(secrets=True)),
                "BERT_CLUSTER_SERVE_WORKERS": str(workers),
                "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
            }
        ),
        _stop_is_success(),
    ):
        uvicorn.run("bert_cluster.serve.app:from_environment", factory=True, workers=workers, **common)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (the worker processes inherit them)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
