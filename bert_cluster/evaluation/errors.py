"""The one exception type for user mistakes (the CLI prints its message on one line and exits 2)."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what the user asked for: unknown task, missing data, unfitting model, bad option."""
