"""Progress of an embed run on stderr: documents/s, tokens/s and the time left (the first process only)."""

from __future__ import annotations

import time
from typing import Any


class ProgressBar:
    """A rich bar for ``embed(progress=...)``; use as a context manager, it appears with the first batch.

    The bar counts tokens, not documents: a long document takes longer, so the time left follows the
    work still to do.
    """

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("embedding {task.fields[documents]}"),
            BarColumn(),
            TextColumn("{task.fields[rates]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.bar.add_task("embed", total=None, documents="", rates="")
        self.started: float | None = None

    def __call__(self, documents: int, tokens: int, documents_total: int, tokens_total: int) -> None:
        """Show this process's documents and tokens done of its share."""
        if not documents_total:
            return  # nothing left to embed (a finished output run again)
        now = time.perf_counter()
        if self.started is None:
            self.started = now
            self.bar.start()
        elapsed = now - self.started
        rates = f"{documents / elapsed:,.1f} docs/s, {tokens / elapsed:,.0f} tokens/s" if elapsed > 0 else ""
        self.bar.update(
            self.task,
            completed=tokens,
            total=max(tokens_total, 1),
            documents=f"{documents:,}/{documents_total:,} documents",
            rates=rates,
        )

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started is not None:
            self.bar.stop()
