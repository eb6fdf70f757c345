"""User mistakes: the one exception type for them and the one way to say an error on one line."""

from __future__ import annotations


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
