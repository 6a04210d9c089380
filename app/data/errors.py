"""How the data pipeline stops: a bad input (app.errors.DataError, naming the file, the line or row and the field)
or the end of its last epoch (`DataExhausted`)."""

from __future__ import annotations

__all__ = ["DataExhausted"]


class DataExhausted(Exception):
    """Every record of the last epoch (`data.epochs`) has been used: the run ends cleanly."""
