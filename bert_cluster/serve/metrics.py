"""The server's Prometheus metrics (prometheus-client), one registry per app.

Requests by route and status with their latency, inputs and tokens embedded, the queue's depth, each
batch's size in inputs, real and padded tokens, its time and its inputs' wait, and the last batch's
tokens per second. Under ``--workers N`` the CLI sets ``PROMETHEUS_MULTIPROC_DIR`` for every worker and
``/metrics`` answers the sum over them (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from bert_cluster.serve.batcher import BatchReport

PREFIX = "bert_cluster_serve"
#: Seconds: a short query in milliseconds to a long document's minute on a small CPU.
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = tuple(2**power for power in range(4, 18))
INPUT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: The routes counted by name; any other path is counted as "other" (a bounded set of labels).
ROUTES = ("/v1/embeddings", "/embed", "/health", "/ready", "/info", "/metrics", "/v1/models")


def multiprocess_dir() -> str | None:
    """The folder of prometheus-client's multiprocess mode, when the CLI runs several workers."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ServerMetrics:
    """The metrics of one app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry

        def name(text: str) -> str:
            return f"{PREFIX}_{text}"

        self.requests = Counter(
            name("requests"), "HTTP requests answered, by route and status", ("route", "status"),
            registry=registry,
        )  # fmt: skip
        self.latency = Histogram(
            name("request_seconds"), "Time from a request's arrival to its answer, by route", ("route",),
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.inputs = Counter(name("inputs"), "Inputs embedded", registry=registry)
        self.tokens = Counter(name("tokens"), "Tokens embedded (after truncation)", registry=registry)
        self.queue_depth = Gauge(
            name("queue_inputs"), "Inputs waiting for a batch", registry=registry, multiprocess_mode="livesum"
        )
        self.in_flight = Gauge(
            name("requests_in_flight"), "Embedding requests queued or running", registry=registry,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.batch_inputs = Histogram(
            name("batch_inputs"), "Inputs per model pass", buckets=INPUT_BUCKETS, registry=registry
        )
        self.batch_tokens = Histogram(
            name("batch_tokens"), "Tokens per model pass", buckets=TOKEN_BUCKETS, registry=registry
        )
        self.batch_padded_tokens = Histogram(
            name("batch_padded_tokens"), "Padded tokens (inputs x longest) per model pass",
            buckets=TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            name("batch_seconds"), "Time of one model pass", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.batches_between_layers = Counter(
            name("batches_between_layers"), "Model passes of short inputs run between a long pass's layers",
            registry=registry,
        )  # fmt: skip
        self.queue_seconds = Histogram(
            name("queue_seconds"), "Time an input waited in the queue", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.tokens_per_second = Gauge(
            name("tokens_per_second"), "Tokens per second of the last model pass", registry=registry,
            multiprocess_mode="mostrecent",
        )  # fmt: skip

    def batch(self, report: BatchReport) -> None:
        """Record one model pass (the batcher's ``on_batch``)."""
        self.batch_inputs.observe(report.inputs)
        self.batch_tokens.observe(report.tokens)
        self.batch_padded_tokens.observe(report.padded_tokens)
        self.batch_seconds.observe(report.seconds)
        if report.between_layers:
            self.batches_between_layers.inc()
        for waited in report.waited:
            self.queue_seconds.observe(waited)
        if not report.failed:
            self.inputs.inc(report.inputs)
            self.tokens.inc(report.tokens)
            if report.seconds > 0:
                self.tokens_per_second.set(report.tokens / report.seconds)

    def answered(self, path: str, status: int, seconds: float) -> None:
        """Record one answered request."""
        route = path if path in ROUTES else "other"
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The text ``/metrics`` answers and its content type (the workers' sum in multiprocess mode)."""
        if multiprocess_dir() is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
