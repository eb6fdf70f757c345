"""Dynamic batching by token budget: a queue of inputs, batches of similar lengths, a bounded wait.

Requests put their inputs in one queue (each with its token count). One loop takes batches from it and
runs them one at a time on a worker thread (the model uses torch's threads; the event loop keeps taking
requests meanwhile). A batch is chosen around an anchor input:

- its padded size, inputs x longest input, stays within ``max_batch_tokens``, and it holds at most
  ``max_batch_requests`` inputs;
- the inputs closest in length to the anchor join first, and only those of a similar length (the longest
  at most ``SIMILAR_RATIO`` times the shortest, or at most ``SIMILAR_SLACK`` tokens longer), so that a
  short query is never padded to a long document's length;
- the anchor is the oldest input, except right after a batch anchored so, when it is the oldest input
  shorter than that batch's longest one: short inputs that arrive behind a long document wait for one
  long batch, not for every long document queued, and every input still runs within two batches of
  becoming the oldest (nothing starves);
- when the batch could still grow, the loop waits for more inputs, at most ``max_wait_s`` after the
  anchor was queued.

With ``interleave`` (the default), short inputs do not wait for a long batch at all: the model calls
``between_layers()`` at each layer (``ModelRunner`` hooks its attention modules), and there, on the
model's thread, one batch of queued inputs at most a ``INTERLEAVE_RATIO``-th of the running batch's
longest runs before the long batch goes on (a batch whose longest input has at least
``INTERLEAVE_MIN_TOKENS``). A query behind an 8,192-token document then waits for one of its layers,
not for all of them. The long batch's numbers do not change (the model keeps no state from
one pass to the next); it takes longer by the short batches run inside it. Only one level: a batch run
between layers is never interrupted itself.

An input whose request went away (its future cancelled: the client disconnected, the server stops) is
dropped from the queue, and a batch's results never go to a future that is no longer waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

#: Inputs of similar length share a batch: the longest at most this many times the shortest ...
SIMILAR_RATIO = 2.0
#: ... or at most this many tokens longer (short inputs batch together whatever their ratio).
SIMILAR_SLACK = 64
#: A queued input runs between the layers of a batch whose longest input is this many times its own ...
INTERLEAVE_RATIO = 4
#: ... and at least this many tokens: a shorter batch runs whole (its pass is over before a query would
#: gain anything, and stopping it would only split batches of queries: 10% fewer short queries per second
#: at concurrency 8 on the Zen 4 without this floor, benchmarks.serve, 2026-12-08).
INTERLEAVE_MIN_TOKENS = 512


@dataclasses.dataclass(eq=False)
class Job(Generic[Item]):
    """One queued input: what the model runs, its token count, and where its result goes."""

    item: Item
    tokens: int
    future: asyncio.Future
    queued: float


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """What one batch was (``Batcher``'s ``on_batch`` gets one after each): for metrics."""

    inputs: int
    tokens: int
    padded_tokens: int
    seconds: float
    waited: tuple[float, ...]
    failed: bool
    between_layers: bool = False

    @classmethod
    def of(
        cls, batch: Sequence[Job], started: float, seconds: float, failed: bool, between_layers: bool = False
    ) -> BatchReport:
        """The report of ``batch``, begun at ``started`` (``time.perf_counter``), ``seconds`` long."""
        return cls(
            inputs=len(batch),
            tokens=sum(job.tokens for job in batch),
            padded_tokens=len(batch) * max(job.tokens for job in batch),
            seconds=seconds,
            waited=tuple(started - job.queued for job in batch),
            failed=failed,
            between_layers=between_layers,
        )


def similar(shortest: int, longest: int) -> bool:
    """Whether inputs of these lengths may share a batch (see the module docstring)."""
    return longest <= SIMILAR_RATIO * shortest or longest - shortest <= SIMILAR_SLACK


def choose_batch(
    jobs: Sequence[Job], max_tokens: int, max_inputs: int, shorter_than: int | None = None
) -> list[Job]:
    """The next batch of ``jobs`` (queued oldest first), anchored as the module docstring says.

    ``shorter_than``: the longest input of the previous batch when that one was anchored at the oldest
    input (then the oldest input shorter than it anchors this one, if any).
    """
    if not jobs:
        return []
    anchor = jobs[0]
    if shorter_than is not None:
        anchor = next((job for job in jobs if job.tokens < shorter_than), anchor)
    order = sorted(
        (job for job in jobs if job is not anchor),
        key=lambda job: (abs(job.tokens - anchor.tokens), job.queued),
    )
    batch, shortest, longest = [anchor], anchor.tokens, anchor.tokens
    for job in order:
        if len(batch) >= max_inputs:
            break
        low, high = min(shortest, job.tokens), max(longest, job.tokens)
        if (len(batch) + 1) * high > max_tokens or not similar(low, high):
            continue
        batch.append(job)
        shortest, longest = low, high
    return batch


class Batcher(Generic[Item, Result]):
    """Runs ``run(items) -> results`` (same order) on batches of queued inputs, one batch at a time.

    Start it with ``start()`` inside the event loop; ``submit`` queues one request's inputs and returns
    their results; ``stop()`` lets the batch in progress finish and fails what is still queued.
    """

    def __init__(
        self,
        run: Callable[[list[Item]], Sequence[Result]],
        max_batch_tokens: int,
        max_batch_requests: int,
        max_wait_s: float,
        on_batch: Callable[[BatchReport], None] | None = None,
        interleave: bool = True,
    ) -> None:
        self._run = run
        self.interleave = interleave
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.max_wait_s = max_wait_s
        self._on_batch = on_batch
        self._queue: list[Job] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._shorter_than: int | None = None
        self._stopping = False
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._running_longest: int | None = None  # the batch in progress, while it runs
        self._model_thread = threading.local()  # .inside: a batch between layers is running
        self.busy = False

    @property
    def queued_inputs(self) -> int:
        """Inputs waiting for a batch (not counting the batch in progress)."""
        return sum(not job.future.done() for job in self._queue)

    @property
    def queued_tokens(self) -> int:
        """Their tokens."""
        return sum(job.tokens for job in self._queue if not job.future.done())

    def start(self) -> None:
        """Start the batching loop in the running event loop."""
        self._wake = asyncio.Event()
        self._stopping = False
        self._event_loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bert-cluster-model")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="bert-cluster-batcher")

    async def stop(self) -> None:
        """Stop taking batches: the one in progress finishes, the inputs still queued fail."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is stopping"))
        self._queue.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def call(self, function: Callable[[], Result]) -> Result:
        """``function()`` on the thread batches run on (after the batch in progress): the warm-up."""
        if self._executor is None:
            raise RuntimeError("the batcher is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, function)

    async def submit(self, inputs: Sequence[tuple[Item, int]]) -> list[Result]:
        """Queue ``(item, tokens)`` pairs and wait for their results, in the same order.

        Cancelled (the client went away), the inputs not yet run leave the queue.

        Raises:
            RuntimeError: the batcher is not running.
            Exception: whatever ``run`` raised for a batch holding one of them.
        """
        if self._task is None or self._task.done() or self._wake is None:
            raise RuntimeError("the batcher is not running")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        jobs = [Job(item, tokens, loop.create_future(), now) for item, tokens in inputs]
        self._queue.extend(jobs)
        self._wake.set()
        try:
            return list(await asyncio.gather(*(job.future for job in jobs)))
        finally:
            for job in jobs:
                job.future.cancel()  # a no-op for those done; the loop drops the others
            self._queue = [job for job in self._queue if not job.future.done()]

    async def _loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._queue = [job for job in self._queue if not job.future.done()]
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._choose()
            deadline = batch[0].queued + self.max_wait_s
            # Wait for more while the batch could still grow and time is left.
            while self._could_grow(batch) and (left := deadline - time.perf_counter()) > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
                self._queue = [job for job in self._queue if not job.future.done()]
                batch = self._choose()
                if not batch or self._stopping:
                    break
            if not batch:
                continue
            # After a batch anchored at the oldest input, the next one favours inputs shorter than it.
            oldest = batch[0] is self._queue[0]
            self._shorter_than = max(job.tokens for job in batch) if oldest else None
            taken = {id(job) for job in batch}
            self._queue = [job for job in self._queue if id(job) not in taken]
            await self._run_batch(loop, batch)

    def _could_grow(self, batch: list[Job]) -> bool:
        """Whether everything queued is in ``batch`` and one more input of its length would still fit."""
        longest = max(job.tokens for job in batch)
        return (
            len(batch) == len(self._queue)
            and len(batch) < self.max_batch_requests
            and (len(batch) + 1) * longest <= self.max_batch_tokens
        )

    def _choose(self) -> list[Job]:
        return choose_batch(self._queue, self.max_batch_tokens, self.max_batch_requests, self._shorter_than)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[Job]) -> None:
        started = time.perf_counter()
        self.busy = True
        failed = False
        self._running_longest = max(job.tokens for job in batch)
        try:
            results = await loop.run_in_executor(self._executor, self._run, [job.item for job in batch])
        except Exception as error:  # the requests of this batch fail; the loop goes on
            failed = True
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(error)
        else:
            for job, result in zip(batch, results, strict=True):
                if not job.future.done():
                    job.future.set_result(result)
        finally:
            self.busy = False
            self._running_longest = None
            for job in batch:  # cancelled while it ran (the loop was): nobody is left waiting forever
                if not job.future.done():
                    job.future.cancel()
        if self._on_batch is not None:
            self._on_batch(BatchReport.of(batch, started, time.perf_counter() - started, failed))

    def between_layers(self) -> None:
        """Run one batch of queued short inputs now (the model's thread calls this at each layer).

        A no-op outside a batch, inside a batch run between layers, without ``interleave``, or when no
        queued input is short enough (module docstring). The inputs are taken from the queue on the event
        loop's thread; their results go back there.
        """
        longest, loop = self._running_longest, self._event_loop
        if not self.interleave or longest is None or loop is None or self._stopping:
            return
        if longest < INTERLEAVE_MIN_TOKENS:
            return
        if getattr(self._model_thread, "inside", False):
            return
        limit = longest // INTERLEAVE_RATIO
        if not any(job.tokens <= limit for job in tuple(self._queue)):  # cheap: no thread hop
            return
        taken: concurrent.futures.Future[list[Job]] = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(self._take_short, limit, taken)
            batch = taken.result(timeout=5.0)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the loop is closing or stuck
            return
        if not batch:
            return
        started = time.perf_counter()
        self._model_thread.inside = True
        try:
            outcome: Sequence[Result] | Exception = self._run([job.item for job in batch])
            if len(outcome) != len(batch):
                raise RuntimeError(f"the model gave {len(outcome)} results for {len(batch)} inputs")
        except Exception as error:  # these requests fail; the long batch goes on
            outcome = error
        finally:
            self._model_thread.inside = False
        seconds = time.perf_counter() - started
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
            loop.call_soon_threadsafe(self._deliver, batch, outcome, started, seconds)

    def _take_short(self, limit: int, taken: concurrent.futures.Future) -> None:
        """On the event loop: a batch of queued inputs of at most ``limit`` tokens, for ``between_layers``."""
        batch: list[Job] = []
        if not self._stopping:
            short = [job for job in self._queue if job.tokens <= limit and not job.future.done()]
            batch = choose_batch(short, self.max_batch_tokens, self.max_batch_requests)
            chosen = {id(job) for job in batch}
            self._queue = [job for job in self._queue if id(job) not in chosen]
        taken.set_result(batch)

    def _deliver(
        self, batch: list[Job], outcome: Sequence[Result] | Exception, started: float, seconds: float
    ) -> None:
        """On the event loop: the results (or the error) of a batch run between layers."""
        failed = isinstance(outcome, Exception)
        for index, job in enumerate(batch):
            if job.future.done():  # its request went away
                continue
            if isinstance(outcome, Exception):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome[index])
        if self._on_batch is not None:
            self._on_batch(BatchReport.of(batch, started, seconds, failed, between_layers=True))
