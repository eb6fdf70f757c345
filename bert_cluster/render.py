"""What the CLI shows with rich: progress while evaluate and tune run, and the tables of their results.

The rows come from the report modules (``report.table_rows``, ``tuner.table_rows``,
``Inspection.table_rows``), so a table on the terminal and the one in the markdown file never differ;
this module only lays them out. The reporters follow ``runner.Reporter``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from bert_cluster.parallel import time_left

if TYPE_CHECKING:
    from bert_cluster.evaluation.report import Results, RunResult, TaskResult
    from bert_cluster.evaluation.tuner import Candidate, TuneResult
    from bert_cluster.inspection import Inspection


class RichReporter:
    """Progress bars with an ETA on stderr (a terminal): tasks, configurations of a task, its items.

    The items' bar counts items and fills by tokens, so its ETA follows the work still to do (the
    batches run longest first).
    """

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("{task.description:<36}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        )
        self._tasks = self._configs = self._items = None

    def start(self, tasks: int) -> None:  # noqa: D102
        self.progress.start()
        self._tasks = self.progress.add_task("tasks", total=tasks, count=f"0/{tasks}")

    def task(self, name: str, configurations: int) -> None:  # noqa: D102
        if self._configs is not None:
            self.progress.remove_task(self._configs)
        self._configs = self.progress.add_task(
            f"{name}: configurations", total=configurations, count=f"0/{configurations}"
        )
        self.progress.update(self._tasks, description=f"tasks ({name})")

    def configuration(self, label: str) -> None:  # noqa: D102
        if self._items is not None:
            self.progress.remove_task(self._items)
        self._items = self.progress.add_task(f"  {label}", total=None, count="")

    def advance(
        self, done: int, total: int, tokens: int | None = None, tokens_total: int | None = None
    ) -> None:
        """See ``runner.Reporter.advance``."""
        if tokens is not None and tokens_total:
            if tokens == 0:  # a model pass starts (after its warm-up batch): so does the ETA's clock
                self.progress.reset(self._items, total=tokens_total, count=f"{done}/{total}")
            self.progress.update(self._items, completed=tokens, total=tokens_total, count=f"{done}/{total}")
        else:
            self.progress.update(self._items, completed=done, total=total, count=f"{done}/{total}")

    def _step(self, bar: Any) -> None:
        self.progress.advance(bar)
        task = next(task for task in self.progress.tasks if task.id == bar)
        self.progress.update(bar, count=f"{task.completed:.0f}/{task.total:.0f}")

    def configuration_done(self, run: RunResult) -> None:  # noqa: D102
        self._step(self._configs)

    def task_done(self, result: TaskResult) -> None:  # noqa: D102
        self._step(self._tasks)

    def finish(self) -> None:  # noqa: D102
        self.progress.stop()


class LogReporter:
    """Plain lines on stderr (a log, where bars cannot redraw): each configuration, progress every 30 s.

    The ETA weighs the items by their tokens when the runner gives them (the batches run longest first,
    so a count of items would make the rest look as slow as the first), from the start of the model pass
    (after its warm-up batch).
    """

    def __init__(
        self, console: Console, every: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console, self.every, self.clock = console, every, clock
        self.name = self.label = ""
        self.began = self.last = 0.0

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def start(self, tasks: int) -> None:  # noqa: D102
        self._line(f"{tasks} task(s)")

    def task(self, name: str, configurations: int) -> None:  # noqa: D102
        self.name = name
        self._line(f"[{name}] {configurations} configuration(s)")

    def configuration(self, label: str) -> None:  # noqa: D102
        self.label, self.began = label, self.clock()
        self.last = self.began

    def advance(
        self, done: int, total: int, tokens: int | None = None, tokens_total: int | None = None
    ) -> None:
        """See ``runner.Reporter.advance``."""
        now = self.clock()
        weighed = tokens is not None and bool(tokens_total)
        starts = tokens == 0 if weighed else done == 0
        if starts:  # a model pass starts (after its warm-up batch): so does the ETA's clock
            self.began = now
        if done and total and now - self.last >= self.every:
            self.last = now
            left = time_left(now - self.began, *((tokens, tokens_total) if weighed else (done, total))) or 0
            share = f"{done}/{total} ({100 * done / total:.0f}%)"
            self._line(f"[{self.name}] {self.label}: {share}, ETA {left:.0f} s")

    def configuration_done(self, run: RunResult) -> None:  # noqa: D102
        scores = ", ".join(f"{key} {value:.2f}" for key, value in run.scores.items())
        speed = "" if run.speedup is None else f", {run.speedup:.2f}x"
        self._line(f"[{self.name}] {run.label}: {scores} ({run.wall_time_s:.1f} s{speed}, {run.backend})")

    def task_done(self, result: TaskResult) -> None:  # noqa: D102
        state = f"ok (data: {result.source})" if result.ok else f"{result.status}: {result.error}"
        self._line(f"[{result.task}] {state}")

    def finish(self) -> None:  # noqa: D102
        pass


def progress_reporter(console: Console) -> RichReporter | LogReporter:
    """Bars on a terminal, plain lines in a log."""
    return RichReporter(console) if console.is_terminal else LogReporter(console)


class CandidateLines:
    """A reporter that also prints one line per tuning candidate (its verdict) on the console."""

    def __init__(self, inner: Any, console: Console) -> None:
        self.inner, self.console = inner, console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def candidate(self, candidate: Candidate) -> None:
        """A candidate is scored: ``label: changes, speedup: verdict``."""
        changes = ", ".join(f"Δ {name} {change:+.2f}" for name, change in candidate.changes.items())
        speed = "" if candidate.speedup is None else f", {candidate.speedup:.2f}×"
        if candidate.screen is not None and candidate.speedup is None:
            speed = " on the screening examples"
        self.console.print(
            f"{candidate.label}: {changes}{speed}: {candidate.status}", markup=False, highlight=False
        )


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int]) -> Table:
    """A rich table of ``rows``: the columns numbered in ``left`` left-aligned, the others right."""
    out = Table(title=title)
    for index, name in enumerate(header):
        out.add_column(name, justify="left" if index in left else "right")
    for row in rows:
        out.add_row(*row)
    return out


def results_table(results: Results) -> Table:
    """An evaluation's summary: task, metric, unmodified, each mode and C as mean ± std (Δ), speed."""
    from bert_cluster.evaluation.report import table_rows

    header, rows = table_rows(results)
    seeds = results.settings.get("seeds") or []
    modes = ", ".join(results.settings.get("modes") or [])
    title = (
        f"{modes} attention, {len(seeds)} seed(s); patched: mean ± std (Δ unmodified); speed: × unmodified"
    )
    return table(title, header, rows, left=(0, 1))


def tune_table(result: TuneResult) -> Table:
    """The trade-off table of a tuning run: one row per candidate tried, the chosen one marked."""
    from bert_cluster.evaluation.tuner import table_rows

    header, rows = table_rows(result)
    judged = ", ".join(display for _, display in result.metrics)
    title = (
        f"{result.task}: budget {result.budget:g} point(s) on {judged}, {result.examples} examples; "
        f"cheapest by {'measured speedup' if result.cost == 'speed' else 'attention cost'}"
    )
    return table(title, header, rows, left=(1, 2, len(header) - 1))


def inspection_table(report: Inspection, per_head: bool = False) -> Table:
    """The table of an inspection: per layer (mean and worst head) or per layer and head."""
    header, rows = report.table_rows(per_head)
    return table(report.table_title(per_head), header, rows, left=(0,))
