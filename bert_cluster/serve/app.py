"""The HTTP layer: routes, request checks, limits, errors and metrics, on FastAPI.

A request is checked (the framework validates its JSON against ``schemas``; then its size, its inputs'
count, emptiness and token counts against the limits), admitted if fewer than
``max_concurrent_requests`` are in flight (else 429 with ``Retry-After``), and its inputs queued in the
``Batcher``, which runs them through the ``ModelRunner``. Every error, the framework's own included,
answers in one shape (``schemas.ErrorResponse``) with a message that says what was wrong and what is
allowed; an unexpected failure answers 500 without a traceback. A client that goes away while its
request waits takes its inputs out of the queue.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import numpy as np
import pydantic_core
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bert_cluster import environment
from bert_cluster.checkpoints import check_model_path, max_positions, resolve_model
from bert_cluster.errors import UserError, one_line
from bert_cluster.serve.batcher import Batcher
from bert_cluster.serve.metrics import ServerMetrics
from bert_cluster.serve.runner import ModelRunner
from bert_cluster.serve.schemas import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbedRequest,
    ErrorResponse,
)
from bert_cluster.serve.settings import ServeSettings

logger = logging.getLogger("bert_cluster.serve")

#: The environment variable that hands ``--workers`` processes their settings (``from_environment``).
SETTINGS_ENV = environment.SERVE_SETTINGS
#: Inputs whose texts hold fewer characters than this are counted on the event loop (a thread hop
#: costs more than counting them).
INLINE_COUNT_CHARS = 4096
#: The tags pydantic puts in an error's location for the branches of ``str | list[str]``.
TEXT_UNION = ("str", "list[str]")
ERROR_TYPES = {
    401: "authentication_error",
    429: "overloaded",
    499: "client_closed_request",
    500: "server_error",
    503: "unavailable",
}


class ApiError(Exception):
    """An answer other than 200: its status, message and headers (``error_response`` renders it)."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.headers, self.param = status, message, headers or {}, param


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
):
    """The one error shape (``schemas.ErrorResponse``)."""
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def check_settings(settings: ServeSettings) -> ServeSettings:
    """``settings`` resolved against the model's config (its positions), without loading its weights.

    Raises:
        UserError: a model that cannot be found or read, or settings that contradict each other.
    """
    from transformers import AutoConfig

    from bert_cluster.checkpoints import quiet

    path = check_model_path(resolve_model(settings.model))
    try:
        with quiet():
            config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"cannot load model {settings.model!r} ({path}): {one_line(error)}") from None
    return settings.resolve(max_positions(config))


class ServerState:
    """What the routes share: settings, model, batcher, metrics, requests in flight, readiness."""

    def __init__(self, settings: ServeSettings, runner: ModelRunner) -> None:
        self.settings = settings
        self.runner = runner
        self.metrics = ServerMetrics()
        self.batcher: Batcher[str, Any] = Batcher(
            lambda texts: self.runner.embed(texts),  # looked up at each batch
            max_batch_tokens=settings.max_batch_tokens or 0,
            max_batch_requests=settings.max_batch_requests,
            max_wait_s=settings.max_wait_ms / 1000,
            on_batch=self._batch_done,
            interleave=settings.interleave,
        )
        self.layers_hooked = runner.call_between_layers(self.batcher.between_layers)
        self.in_flight = 0
        self.ready = threading.Event()
        self.failure: str | None = None
        self._tokens_per_second: float | None = None

    def _batch_done(self, report: Any) -> None:
        self.metrics.batch(report)
        self.metrics.queue_depth.set(self.batcher.queued_inputs)
        if not report.failed and report.seconds > 0:
            rate = report.padded_tokens / report.seconds
            previous = self._tokens_per_second
            self._tokens_per_second = rate if previous is None else 0.8 * previous + 0.2 * rate

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained (at least 1): for 429's ``Retry-After``."""
        rate = self._tokens_per_second
        if not rate:
            return 1
        return max(1, math.ceil(self.batcher.queued_tokens / rate))


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def authorized(request: Request) -> None:
    """With an API key set: ``Authorization: Bearer KEY`` or 401 (compared in constant time)."""
    key = _state(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(
            401,
            "missing or wrong API key: send the header Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def admitted(request: Request) -> AsyncIterator[None]:
    """Count the request in flight, or answer 429 when ``max_concurrent_requests`` are already."""
    state = _state(request)
    limit = state.settings.max_concurrent_requests
    if state.in_flight >= limit:
        raise ApiError(
            429,
            f"the server is at its limit of {limit} concurrent requests (max_concurrent_requests): "
            "retry after the time in Retry-After",
            headers={"Retry-After": str(state.retry_after())},
        )
    state.in_flight += 1
    state.metrics.in_flight.set(state.in_flight)
    try:
        yield
    finally:
        state.in_flight -= 1
        state.metrics.in_flight.set(state.in_flight)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the request's body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result; cancelled (its inputs leave the queue) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the request itself was cancelled (the server gave up on it)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ApiError(499, "the client closed the connection before the answer")
    return task.result()


async def embed_texts(
    request: Request, texts: str | list[str], truncate: bool, field: str
) -> tuple[np.ndarray, list[int]]:
    """Check ``texts`` against the limits, run them through the batcher: their vectors and tokens.

    Raises:
        ApiError: 413 (too many inputs, an input past max_input_tokens without truncate), 422 (no
            input, an empty one), 503 (the server is stopping or the model failed).
    """
    state = _state(request)
    settings = state.settings
    items = [texts] if isinstance(texts, str) else texts
    if not items:
        raise ApiError(422, f"{field} is an empty list: give a text or a list of texts", param=field)
    if len(items) > settings.max_client_batch_size:
        raise ApiError(
            413,
            f"{field} holds {len(items)} texts; at most {settings.max_client_batch_size} are allowed per "
            "request (max_client_batch_size): split the request",
            param=field,
        )
    empty = [index for index, text in enumerate(items) if not text]
    if empty:
        where = "" if isinstance(texts, str) else f" at position {empty[0]}"
        raise ApiError(422, f"{field} holds an empty text{where}: every text needs at least one character")
    runner = state.runner
    if sum(len(text) for text in items) < INLINE_COUNT_CHARS:
        counts = runner.count_tokens(items)
    else:
        counts = await asyncio.get_running_loop().run_in_executor(runner.counting, runner.count_tokens, items)
    longest = settings.max_input_tokens or 0
    too_long = [index for index, count in enumerate(counts) if count > longest]
    if too_long and not truncate:
        index = too_long[0]
        where = "" if isinstance(texts, str) else f" at position {index}"
        raise ApiError(
            413,
            f"the text{where} has {counts[index]} tokens; at most {longest} are allowed (max_input_tokens): "
            'shorten it or send "truncate": true',
            param=field,
        )
    tokens = [min(count, longest) for count in counts]
    try:
        rows = await unless_disconnected(request, state.batcher.submit(list(zip(items, tokens, strict=True))))
    except RuntimeError as error:
        raise ApiError(503, f"the server cannot embed now: {one_line(error)}") from None
    return np.stack(rows), tokens


def _json(body: Any) -> Response:
    # pydantic-core's serialiser (FastAPI's own): floats as the shortest text that reads back the same.
    return Response(pydantic_core.to_json(body), media_type="application/json")


def _json_type(value: Any) -> str:
    """A value's JSON type name (what the client sent, in its own terms)."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return names.get(type(value), "an object")


def _too_large(limit: int) -> str:
    return (
        f"the request body is larger than the {limit} bytes allowed (payload_limit): send fewer or "
        "shorter texts per request"
    )


class _EveryRequest:
    """ASGI middleware around every HTTP request: its metrics and the payload limit.

    Each request's route, status and time go into the metrics; a body too large answers 413 in the one
    error shape: a declared length past ``limit`` bytes before the body is read, a streamed body once it
    passes the limit. (Starlette's own body limit answers in plain text, and replaces any answer when
    the declared length is too large.)
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, limit: int) -> None:
        self.app, self.metrics, self.limit = app, metrics, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began, status, received = time.perf_counter(), 500, 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413)  # the framework lets it through to the 413 handler
            return message

        try:
            declared = Headers(scope=scope).get("content-length", "")
            if declared.isdigit() and int(declared) > self.limit:
                await error_response(413, _too_large(self.limit))(scope, receive, send_status)
            else:
                await self.app(scope, counted, send_status)
        finally:
            self.metrics.answered(scope["path"], status, time.perf_counter() - began)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One line from the framework's problems: where and what, the first few, and what is allowed."""
    problems = list(error.errors())
    if any(problem.get("type") == "json_invalid" for problem in problems):
        reason = next(p for p in problems if p.get("type") == "json_invalid").get("ctx", {}).get("error")
        return f"the body is not valid JSON ({reason or 'malformed'})", None
    lines: dict[str, str] = {}
    # Deepest first: for a list of texts, the branch that names the bad position speaks.
    for problem in sorted(problems, key=lambda problem: -len(problem.get("loc", ()))):
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        if not location:
            return "the body must be a JSON object (send Content-Type: application/json)", None
        field = location[0]
        if len(location) > 1 and location[1] in TEXT_UNION:  # "input": a text or a list of texts
            position = next((part for part in location[2:] if part.isdigit()), None)
            got = _json_type(problem.get("input"))
            what = f"position {position} is {got}" if position is not None else f"got {got}"
            lines.setdefault(field, f"{field} must be a string or a list of strings ({what})")
        else:
            lines.setdefault(".".join(location), f"{'.'.join(location)}: {problem.get('msg', 'invalid')}")
    first = next(iter(lines), None)
    return "; ".join(list(lines.values())[:3]), first.split(".")[0] if first else None


def create_app(settings: ServeSettings | str, **options: Any) -> FastAPI:
    """The ASGI app serving ``settings`` (or a model path and ``ServeSettings``' fields as keywords).

    The model loads here; the warm-up runs when the app starts (its lifespan), and ``/ready`` answers
    200 once it is done.

    Raises:
        UserError: bad settings, settings that contradict each other, or a model that cannot be loaded.
    """
    if isinstance(settings, str):
        settings = ServeSettings(model=settings, **options)
    elif options:
        raise TypeError("give either ServeSettings or a model path with keywords, not both")
    settings = check_settings(settings)
    runner = ModelRunner(settings)
    state = ServerState(settings, runner)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.batcher.start()
        if settings.warmup:
            asyncio.get_running_loop().create_task(_warm_up(state))
        else:
            state.ready.set()
        try:
            yield
        finally:
            state.ready.clear()
            await state.batcher.stop()

    app = FastAPI(
        title="bert-cluster serve",
        summary="Sentence embeddings over HTTP (OpenAI- and TEI-style), clustered attention for long inputs.",
        version=environment.bert_cluster_version(),
        lifespan=lifespan,
    )
    app.state.server = state
    _add_error_handlers(app, settings)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(_EveryRequest, metrics=state.metrics, limit=settings.payload_limit)
    _add_routes(app, state)
    return app


async def _warm_up(state: ServerState) -> None:
    try:
        await state.batcher.call(state.runner.warm_up)  # on the model's thread, before any batch
    except Exception as error:  # /health and /ready say so; the orchestrator restarts the server
        state.failure = f"warm-up failed: {one_line(error)}"
        logger.error("bert-cluster serve: %s", state.failure)
        return
    state.ready.set()


def _add_error_handlers(app: FastAPI, settings: ServeSettings) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> Response:
        return error_response(error.status, error.message, error.headers, error.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Response:
        message, param = _validation_message(error)
        return error_response(422, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code == 413:
            message = _too_large(settings.payload_limit)
        elif error.status_code == 400 and isinstance(error.__cause__, UnicodeDecodeError):
            return error_response(422, "the body is not valid UTF-8: send JSON encoded as UTF-8")
        elif error.status_code == 404:
            message = f"no route {request.url.path}: see GET /docs for the routes"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return error_response(error.status_code, message, getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        logger.exception("bert-cluster serve: unexpected error on %s", request.url.path)
        return error_response(500, f"internal error ({type(error).__name__}); the server log has the details")


def _encode_vectors(vectors: np.ndarray, encoding: str) -> list[Any]:
    if encoding == "base64":
        little = vectors.astype("<f4", copy=False)
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    return vectors.tolist()


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings, runner = state.settings, state.runner
    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse} for status in (401, 413, 422, 429, 503)
    }
    guarded = [Depends(authorized)]

    @app.post(
        "/v1/embeddings",
        response_model=EmbeddingsResponse,
        responses=errors,
        dependencies=[*guarded, Depends(admitted)],
    )
    async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
        """OpenAI-style embeddings: the vectors in request order, the tokens read, the model's name."""
        if body.dimensions is not None and body.dimensions != runner.dimension:
            raise ApiError(
                422,
                f"dimensions {body.dimensions}: this model gives {runner.dimension} dimensions only",
                param="dimensions",
            )
        vectors, tokens = await embed_texts(request, body.input, body.truncate, "input")
        data = [
            {"object": "embedding", "index": index, "embedding": vector}
            for index, vector in enumerate(_encode_vectors(vectors, body.encoding_format))
        ]
        used = sum(tokens)
        return _json(
            {
                "object": "list",
                "data": data,
                "model": settings.served_name,
                "usage": {"prompt_tokens": used, "total_tokens": used},
            }
        )

    @app.post(
        "/embed",
        response_model=list[list[float]],
        responses=errors,
        dependencies=[*guarded, Depends(admitted)],
    )
    async def embed(body: EmbedRequest, request: Request) -> Response:
        """TEI-style embeddings: a list of vectors in request order."""
        vectors, _ = await embed_texts(request, body.inputs, body.truncate, "inputs")
        if body.normalize and not runner.normalizes:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, np.finfo(np.float32).tiny)
        return _json(vectors.tolist())

    @app.get("/health")
    async def health() -> Response:
        """Alive: 200 unless the warm-up failed (then 503 with the reason)."""
        if state.failure is not None:
            return error_response(503, state.failure)
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Ready for traffic: 200 once the warm-up is done, 503 before (and while stopping)."""
        if state.failure is not None:
            return error_response(503, state.failure)
        if not state.ready.is_set():
            return error_response(503, "warming up: the model has not run its first batch yet")
        return _json({"status": "ready"})

    @app.get("/info", dependencies=guarded)
    async def info() -> Response:
        """The model, its attention settings, the limits, the warm-up and the versions."""
        return _json(_info(state))

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> Response:
        """OpenAI-style list of models: the one this server runs."""
        entry = {"id": settings.served_name, "object": "model", "created": 0, "owned_by": "bert-cluster"}
        return _json({"object": "list", "data": [entry]})

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        """Prometheus metrics (text format)."""
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)


def _info(state: ServerState) -> dict[str, Any]:
    settings, runner = state.settings, state.runner
    encoder = runner.encoder
    config = settings.config
    names = ("bert-cluster", "torch", "transformers", "sentence-transformers", "fastapi", "uvicorn")
    limits = (
        "max_input_tokens", "max_batch_tokens", "max_batch_requests", "max_wait_ms", "max_client_batch_size",
        "max_concurrent_requests", "payload_limit",
    )  # fmt: skip
    batching = {"interleave": settings.interleave, "layers_hooked": state.layers_hooked}
    return {
        "model": settings.served_name,
        "model_path": encoder.path,
        "dimension": runner.dimension,
        "positions": encoder.positions,
        "modules": encoder.modules,
        "exact": settings.exact,
        "attention": None if config is None else config.to_dict(),
        "device": settings.device,
        "dtype": settings.dtype,
        "threads": _threads(),
        "workers": environment.serve_workers(),
        "limits": {name: getattr(settings, name) for name in limits},
        "batching": batching,
        "api_key": settings.api_key is not None,
        "cors_origins": list(settings.cors_origins),
        "ready": state.ready.is_set(),
        "warmup": runner.warmup,
        "versions": {name: environment.package_version(name) for name in names},
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def from_environment() -> FastAPI:
    """The app of the settings in ``$BERT_CLUSTER_SERVE_SETTINGS`` (each ``--workers`` process's)."""
    text = environment.serve_settings()
    if not text:
        raise UserError(f"${SETTINGS_ENV} is not set: start the server with `bert-cluster serve`")
    return create_app(ServeSettings.from_dict(json.loads(text)))
