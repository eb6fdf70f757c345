"""Progress of an embed run on stderr: documents/s, tokens/s and the time left (the first process only)."""

from __future__ import annotations

import time
from typing import Any

from bert_cluster.parallel import time_left

#: The narrowest bar drawn; the texts beside it are cut to what fits the console, least useful first.
MIN_BAR = 10


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    """A rich bar for ``embed(progress=...)``; use as a context manager, it appears with the first batch.

    The bar counts tokens, not documents: a long document takes longer, so the time left follows the
    work still to do. The line always fits the console: on a narrow one the rates go first, then the
    elapsed time (rich would otherwise cut the time left to ``0:00:…``).
    """

    def __init__(self, console: Any, clock: Any = time.perf_counter) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        self.console, self.clock = console, clock
        self.bar = Progress(
            TextColumn("{task.fields[head]}"),
            BarColumn(bar_width=None),
            TextColumn("{task.fields[tail]}"),
            console=console,
        )
        self.task = self.bar.add_task("embed", total=None, head="embedding", tail="")
        self.started: float | None = None

    def texts(self, documents: int, tokens: int, documents_total: int, tokens_total: int) -> tuple[str, str]:
        """The texts left and right of the bar, cut to the console's width."""
        elapsed = self.clock() - (self.started if self.started is not None else self.clock())
        head = f"embedding {documents:,}/{documents_total:,} documents"
        left = f"{_clock(time_left(elapsed, tokens, tokens_total))} left"
        rates = f"{documents / elapsed:,.1f} docs/s, {tokens / elapsed:,.0f} tokens/s" if elapsed > 0 else ""
        room = self.console.width - MIN_BAR - 2  # rich puts a space between columns
        for tail in (f"{rates}  {_clock(elapsed)}, {left}", f"{_clock(elapsed)}, {left}", left):
            if len(head) + 1 + len(tail) <= room:
                return head, tail
        return f"{documents:,}/{documents_total:,}"[: max(room - len(left) - 1, 0)], left

    def __call__(self, documents: int, tokens: int, documents_total: int, tokens_total: int) -> None:
        """Show this process's documents and tokens done of its share."""
        if not documents_total:
            return  # nothing left to embed (a finished output run again)
        if self.started is None:
            self.started = self.clock()
            self.bar.start()
        head, tail = self.texts(documents, tokens, documents_total, tokens_total)
        self.bar.update(self.task, completed=tokens, total=max(tokens_total, 1), head=head, tail=tail)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started is not None:
            self.bar.stop()
