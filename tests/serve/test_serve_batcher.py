"""The batcher alone (no model, no HTTP): budget, grouping, fairness, bounded wait, cancellation, failures."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from bert_cluster.serve.batcher import INTERLEAVE_MIN_TOKENS, Batcher, Job, choose_batch, similar

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def jobs(lengths: list[int]) -> list[Job]:
    loop = asyncio.new_event_loop()
    try:
        return [Job(f"t{i}", n, loop.create_future(), float(i)) for i, n in enumerate(lengths)]
    finally:
        loop.close()


class Recorder:
    """A model stand-in: each text's result is its own text; it records every batch it ran."""

    def __init__(self, gate: threading.Event | None = None, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.gate, self.fail_on = gate, fail_on

    def __call__(self, items: list[str]) -> list[str]:
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(list(items))
        if self.fail_on in items:
            raise ValueError(f"cannot run {self.fail_on}")
        return [f"vector of {item}" for item in items]


async def started(batcher: Batcher) -> Batcher:
    batcher.start()
    return batcher


def test_a_batch_keeps_the_budget_and_groups_similar_lengths():
    queued = jobs([40, 30, 2000, 50, 1800, 12, 60, 2048])
    batch = choose_batch(queued, max_tokens=4096, max_inputs=64)
    # Anchored at the oldest (40 tokens): the short ones, never a long one padded to 2,000.
    assert [job.tokens for job in batch] == [40, 30, 50, 60, 12]
    assert len(batch) * max(job.tokens for job in batch) <= 4096
    long_batch = choose_batch(queued[2:], max_tokens=4096, max_inputs=64)
    # Anchored at 2,000: the closest length joins first (2,048), and 3 x 2,048 > 4,096 keeps 1,800 out.
    assert [job.tokens for job in long_batch] == [2000, 2048]
    assert len(choose_batch(jobs([10] * 100), max_tokens=4096, max_inputs=16)) == 16


def test_an_input_as_long_as_the_budget_runs_alone():
    queued = jobs([4096, 4096, 10])
    assert [job.tokens for job in choose_batch(queued, 4096, 64)] == [4096]


def test_right_after_a_batch_anchored_at_the_oldest_the_oldest_shorter_input_anchors():
    queued = jobs([8192, 8192, 20, 30])
    assert [job.tokens for job in choose_batch(queued, 8192, 64, shorter_than=8192)] == [20, 30]
    assert [job.tokens for job in choose_batch(queued, 8192, 64, shorter_than=None)] == [8192]


def test_similar_lengths():
    assert similar(10, 60) and similar(1000, 2000)
    assert not similar(20, 8192) and not similar(100, 300)


async def test_each_request_gets_its_own_results_in_order():
    recorder = Recorder()
    batcher = await started(Batcher(recorder, 1000, 8, max_wait_s=0.005))
    try:
        requests = [[(f"r{r}-{i}", 5 + (r * 7 + i) % 40) for i in range(1 + r % 3)] for r in range(60)]
        answers = await asyncio.gather(*(batcher.submit(request) for request in requests))
    finally:
        await batcher.stop()
    for request, answer in zip(requests, answers, strict=True):
        assert answer == [f"vector of {text}" for text, _ in request]
    assert sum(len(batch) for batch in recorder.batches) == sum(len(r) for r in requests)
    assert max(len(batch) for batch in recorder.batches) <= 8


async def test_short_inputs_wait_behind_one_long_batch_not_every_long_document():
    gate = threading.Event()
    recorder = Recorder(gate)
    batcher = await started(Batcher(recorder, 8192, 64, max_wait_s=0.0))
    try:
        first = asyncio.ensure_future(batcher.submit([("long-0", 8192)]))
        await asyncio.sleep(0.05)  # long-0 is running (held at the gate); the rest queue behind it
        longs = [asyncio.ensure_future(batcher.submit([(f"long-{i}", 8192)])) for i in (1, 2, 3)]
        await asyncio.sleep(0.01)
        shorts = [asyncio.ensure_future(batcher.submit([(f"short-{i}", 20 + i)])) for i in range(5)]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, *longs, *shorts)
    finally:
        await batcher.stop()
    # long-0 was running; right after it every short (one batch), then the longs, oldest first.
    assert recorder.batches == [
        ["long-0"],
        [f"short-{i}" for i in range(5)],
        ["long-1"],
        ["long-2"],
        ["long-3"],
    ], recorder.batches


async def test_a_long_document_is_not_starved_by_a_stream_of_short_queries():
    recorder = Recorder()
    runs = []

    def slow(items):
        time.sleep(0.01)
        runs.append(list(items))
        return recorder(items)

    batcher = await started(Batcher(slow, 8192, 64, max_wait_s=0.0))
    try:
        stream = [asyncio.ensure_future(batcher.submit([("short-0", 20)]))]
        await asyncio.sleep(0.001)
        long = asyncio.ensure_future(batcher.submit([("long", 4000)]))
        for i in range(1, 30):  # shorts keep arriving while the long document waits
            stream.append(asyncio.ensure_future(batcher.submit([(f"short-{i}", 20)])))
            await asyncio.sleep(0.004)
        await asyncio.gather(long, *stream)
    finally:
        await batcher.stop()
    position = next(index for index, batch in enumerate(runs) if "long" in batch)
    assert position <= 2, runs  # the oldest within two batches of becoming the oldest


async def test_a_lone_input_waits_at_most_the_bounded_wait_and_a_full_batch_not_at_all():
    recorder = Recorder()
    batcher = await started(Batcher(recorder, 1000, 2, max_wait_s=0.3))
    try:
        began = time.perf_counter()
        await batcher.submit([("alone", 10)])
        alone = time.perf_counter() - began
        began = time.perf_counter()
        await batcher.submit([("a", 10), ("b", 10)])  # max_batch_requests=2: full, runs at once
        full = time.perf_counter() - began
    finally:
        await batcher.stop()
    assert 0.3 <= alone < 5.0
    assert full < 0.3


@contextlib.asynccontextmanager
async def one_batch_running(max_batch_tokens: int = 10_000, max_batch_requests: int = 64):
    """A batcher whose first batch ("running") is held at a gate: (batcher, gate, recorder, running)."""
    gate = threading.Event()
    recorder = Recorder(gate)
    batcher = await started(Batcher(recorder, max_batch_tokens, max_batch_requests, max_wait_s=0.0))
    running = asyncio.ensure_future(batcher.submit([("running", 10)]))
    await asyncio.sleep(0.05)
    try:
        yield batcher, gate, recorder, running
    finally:
        gate.set()
        await batcher.stop()


async def test_a_cancelled_request_leaves_the_queue_and_the_batcher_goes_on():
    async with one_batch_running() as (batcher, gate, recorder, running):
        gone = asyncio.ensure_future(batcher.submit([("gone", 10), ("gone-too", 10)]))
        kept = asyncio.ensure_future(batcher.submit([("kept", 10)]))
        await asyncio.sleep(0.01)
        assert batcher.queued_inputs == 3
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert batcher.queued_inputs == 1
        gate.set()
        assert await running == ["vector of running"]
        assert await kept == ["vector of kept"]
        assert await batcher.submit([("after", 10)]) == ["vector of after"]
    ran = [item for batch in recorder.batches for item in batch]
    assert "gone" not in ran and "gone-too" not in ran


async def test_a_request_cancelled_while_its_batch_runs_does_not_break_the_loop():
    async with one_batch_running() as (batcher, gate, _, running):
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        gate.set()
        assert await batcher.submit([("next", 10)]) == ["vector of next"]


async def test_a_failing_batch_fails_its_requests_only():
    recorder = Recorder(fail_on="bad")
    batcher = await started(Batcher(recorder, 10_000, 64, max_wait_s=0.0))
    try:
        with pytest.raises(ValueError, match="cannot run bad"):
            await batcher.submit([("bad", 10)])
        assert await batcher.submit([("good", 10)]) == ["vector of good"]
    finally:
        await batcher.stop()


async def test_stop_finishes_the_batch_in_progress_and_fails_the_queued_inputs():
    async with one_batch_running(max_batch_tokens=10, max_batch_requests=1) as (batcher, gate, _, running):
        queued = asyncio.ensure_future(batcher.submit([("queued", 10)]))
        await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.01)
        gate.set()
        await stopping
        assert await running == ["vector of running"]
        with pytest.raises(RuntimeError, match="stopping"):
            await queued
        with pytest.raises(RuntimeError, match="not running"):
            await batcher.submit([("late", 10)])


class Layered:
    """A model stand-in with layers: at each it calls the batcher's ``between_layers``, as
    ``ModelRunner``'s hooks do; a batch holding ``hold_on`` waits at ``hold`` after its first layer."""

    def __init__(self, layers: int = 3, hold_on: str = "long", fail_on: str | None = None) -> None:
        self.batcher: Batcher | None = None
        self.layers, self.hold_on, self.fail_on = layers, hold_on, fail_on
        self.hold = threading.Event()
        self.log: list[tuple[tuple[str, ...], int]] = []
        self.depth = self.deepest = 0

    def __call__(self, items: list[str]) -> list[str]:
        assert self.batcher is not None
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        try:
            for layer in range(self.layers):
                self.batcher.between_layers()
                self.log.append((tuple(items), layer))
                if layer == 0 and self.hold_on in items:
                    self.hold.wait(10)
            if self.fail_on in items:
                raise ValueError(f"cannot run {self.fail_on}")
            return [f"vector of {item}" for item in items]
        finally:
            self.depth -= 1


async def layered(model: Layered, interleave: bool = True, **limits) -> Batcher:
    model.batcher = Batcher(model, limits.get("tokens", 16384), 64, max_wait_s=0.0, interleave=interleave)
    return await started(model.batcher)


async def held_long_with_shorts(model: Layered, shorts: list[tuple[str, int]], length: int = 8192):
    """The long document running, held after its first layer, with ``shorts`` queued behind it."""
    batcher = model.batcher
    long = asyncio.ensure_future(batcher.submit([("long", length)]))
    while not model.log:
        await asyncio.sleep(0.005)
    waiting = [asyncio.ensure_future(batcher.submit([short])) for short in shorts]
    while batcher.queued_inputs < len(shorts):
        await asyncio.sleep(0.005)
    return long, waiting


async def test_short_inputs_run_between_the_layers_of_a_long_batch_and_get_their_own_results():
    model = Layered()
    reports = []
    batcher = await layered(model)
    batcher._on_batch = reports.append
    finished: list[str] = []
    try:
        long, shorts = await held_long_with_shorts(model, [(f"short-{i}", 20 + i) for i in range(3)])
        long.add_done_callback(lambda _: finished.append("long"))
        for short in shorts:
            short.add_done_callback(lambda _: finished.append("short"))
        model.hold.set()
        answers = await asyncio.gather(long, *shorts)
    finally:
        await batcher.stop()
    shorts_batch = tuple(f"short-{i}" for i in range(3))
    # The long batch's first layer, then the shorts' whole pass (one batch), then the long's other layers.
    shorts_pass = [(shorts_batch, layer) for layer in range(3)]
    assert model.log == [(("long",), 0), *shorts_pass, (("long",), 1), (("long",), 2)]
    assert answers == [["vector of long"], *([f"vector of short-{i}"] for i in range(3))]
    assert finished == ["short"] * 3 + ["long"]
    assert model.deepest == 2  # one level: the shorts' own layers ran nothing inside them
    assert [report.between_layers for report in reports] == [True, False]
    assert reports[0].inputs == 3 and reports[0].padded_tokens == 3 * 22


async def test_without_interleave_or_when_not_short_enough_inputs_wait_for_the_whole_batch():
    cases = (
        (False, 8192, ("short", 20)),
        (True, 8192, ("quarter-plus-one", 8192 // 4 + 1)),
        (True, INTERLEAVE_MIN_TOKENS - 1, ("short", 20)),  # a batch under the floor runs whole
    )
    for interleave, length, queued in cases:
        model = Layered()
        batcher = await layered(model, interleave=interleave)
        try:
            long, (other,) = await held_long_with_shorts(model, [queued], length)
            model.hold.set()
            await asyncio.gather(long, other)
        finally:
            await batcher.stop()
        assert [items for items, _ in model.log] == [("long",)] * 3 + [(queued[0],)] * 3, (length, queued)


async def test_a_failing_batch_between_layers_fails_its_requests_only():
    model = Layered(fail_on="bad")
    batcher = await layered(model)
    try:
        long, (bad,) = await held_long_with_shorts(model, [("bad", 10)])
        model.hold.set()
        assert await long == ["vector of long"]
        with pytest.raises(ValueError, match="cannot run bad"):
            await bad
        assert await batcher.submit([("good", 10)]) == ["vector of good"]
    finally:
        await batcher.stop()


async def test_stopping_takes_nothing_between_layers_and_fails_what_is_queued():
    model = Layered()
    batcher = await layered(model)
    long, (short,) = await held_long_with_shorts(model, [("short", 20)])
    stopping = asyncio.ensure_future(batcher.stop())
    await asyncio.sleep(0.01)
    model.hold.set()
    await stopping
    assert await long == ["vector of long"]
    with pytest.raises(RuntimeError, match="stopping"):
        await short
    assert [items for items, _ in model.log] == [("long",)] * 3
