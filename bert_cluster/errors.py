"""User mistakes: the one exception type for them, the one way to say an error on one line, input checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class UserError(ValueError):
    """A mistake in what the user asked for: unknown task, missing data, unfitting model, bad option."""


def one_line(error: BaseException) -> str:
    """The first line of the message (the type name when it has none): what the CLI and reports show."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int, else a ``UserError`` naming ``name`` (config.py's check)."""
    from bert_cluster.config import check_int

    try:
        check_int(name, value, 1, 2**63 - 1)
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None
    return value  # type: ignore[return-value]


def parse_clusters(value: int | str | Sequence[int | str]) -> tuple[int, ...]:
    """Cluster counts from ``25``, ``"10,25,50"`` or ``[10, 25]``: positive ints, duplicates dropped."""
    parts = [value] if isinstance(value, (int, str)) else list(value)
    items = [piece.strip() if isinstance(piece, str) else piece for part in parts for piece in _split(part)]
    counts = []
    for item in items:
        digits = isinstance(item, str) and item.isdigit()
        if isinstance(item, bool) or not (digits or isinstance(item, int)) or int(item) < 1:
            raise UserError(
                f"malformed cluster list {value!r}: clusters must be positive ints separated by commas, "
                "e.g. 10,25,50"
            )
        counts.append(int(item))
    if not counts:
        raise UserError("the cluster list is empty: give positive ints separated by commas, e.g. 10,25,50")
    return tuple(dict.fromkeys(counts))


def _split(part: Any) -> list[Any]:
    return part.split(",") if isinstance(part, str) else [part]
