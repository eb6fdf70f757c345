"""The processes of a run and the timed, sharded batch loop that every kind's model pass goes through.

One process is the default. Under ``accelerate launch`` or ``torchrun`` (``WORLD_SIZE`` > 1) accelerate's
``PartialState`` joins the process group (gloo for ``--device cpu``, NCCL on GPUs): ``map`` then gives each
process every P-th batch
of the same length-sorted batches a single process would run, and gathers the per-item outputs back in
order on every process, so metrics (and scores) are those of a one-process run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

#: ``advance(done, total, tokens_done, tokens_total)``: items of this process scored so far, out of its
#: share, and their tokens: a long item takes longer, so the time left is weighted by tokens
#: (``time_left``), while the count shown is items.
Progress = Callable[[int, int, int, int], None]


def time_left(elapsed: float, done: float, total: float) -> float | None:
    """Seconds left if the ``total - done`` units of work still to do go at the pace of the ``done`` ones.

    None before any work is done. Give tokens, not items: the batches run longest first, so by items the
    first (longest) ones would make the rest look as slow.
    """
    if done <= 0 or elapsed < 0:
        return None
    return elapsed * max(total - done, 0) / done


@dataclasses.dataclass
class Timing:
    """What this process measured in one configuration: model passes after the warm-up batch."""

    seconds: float = 0.0
    items: int = 0
    tokens: int = 0
    warmed_up: bool = False


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), so padding costs little."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def check_device(device: str) -> str:
    """``cpu`` or ``cuda[:N]`` with a GPU present (every command's ``--device``)."""
    import torch

    from bert_cluster.errors import UserError

    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r} asked for, but torch sees no CUDA GPU here; use --device cpu")
        return device
    raise UserError(f"device must be cpu or cuda (or cuda:N), got {device!r}")


def is_main_process() -> bool:
    """False in every launched process but the first (the one that prints and writes)."""
    return int(os.environ.get("RANK", "0")) == 0


class Workers:
    """This run's processes (accelerate's when launched) and the timing of the current configuration."""

    def __init__(self, device: str = "cpu") -> None:
        self.state: Any = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState

            # cpu=True makes the processes join over gloo (accelerate's MULTI_CPU), with or without GPUs.
            self.state = PartialState(cpu=device == "cpu")
        self.timing = Timing()

    @property
    def count(self) -> int:
        """The number of processes."""
        return 1 if self.state is None else self.state.num_processes

    @property
    def rank(self) -> int:
        """This process's index (0 writes the reports)."""
        return 0 if self.state is None else self.state.process_index

    @property
    def is_main(self) -> bool:
        """True on the process that reports and writes."""
        return self.rank == 0

    def device(self, requested: str) -> str:
        """The device of this process: a launched GPU run gives each process its own GPU."""
        if self.state is not None and requested.startswith("cuda"):
            return str(self.state.device)
        return requested

    def gather(self, values: list[Any]) -> list[Any]:
        """Every process's ``values``, concatenated in rank order, on every process."""
        if self.state is None:
            return list(values)
        from accelerate.utils import gather_object

        return list(gather_object(list(values)))

    def map(
        self,
        function: Callable[[list[Any]], Sequence[Any]],
        items: Sequence[Any],
        lengths: Sequence[int],
        batch_size: int,
        advance: Progress | None = None,
    ) -> list[Any]:
        """``function`` over length-sorted batches of ``items``; one output per item, in the items' order.

        ``lengths`` are the items' real token counts (they sort the batches and count tokens/s). This
        process runs batches ``rank, rank + P, ...``; the first of them runs once more before the clock
        starts (a warm-up: lazy initialisation, kernel loading, allocator growth).
        """
        import torch

        batches = length_sorted_batches(lengths, batch_size)[self.rank :: self.count]
        mine = sum(len(batch) for batch in batches)
        mine_tokens = sum(lengths[index] for batch in batches for index in batch)
        synchronize = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
        if batches and not self.timing.warmed_up:
            function([items[index] for index in batches[0]])
            self.timing.warmed_up = True
        outputs: list[tuple[int, Any]] = []
        done = tokens = 0
        if advance is not None:
            advance(0, mine, 0, mine_tokens)  # after the warm-up: the clock of the time left starts here
        for batch in batches:
            synchronize()
            began = time.perf_counter()
            results = function([items[index] for index in batch])
            synchronize()
            self.timing.seconds += time.perf_counter() - began
            self.timing.items += len(batch)
            batch_tokens = sum(lengths[index] for index in batch)
            self.timing.tokens += batch_tokens
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} items gave {len(results)} outputs")
            outputs.extend(zip(batch, results, strict=True))
            done += len(batch)
            tokens += batch_tokens
            if advance is not None:
                advance(done, mine, tokens, mine_tokens)
        ordered: list[Any] = [None] * len(items)
        for index, result in self.gather(outputs):
            ordered[index] = result
        return ordered

    def combined_timing(self) -> Timing:
        """The configuration's timing over all processes: the slowest process's seconds, summed counts."""
        parts = self.gather([dataclasses.astuple(self.timing)])
        return Timing(
            seconds=max(part[0] for part in parts),
            items=sum(part[1] for part in parts),
            tokens=sum(part[2] for part in parts),
            warmed_up=all(part[3] for part in parts),
        )
