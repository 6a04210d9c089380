"""How the data pipeline stops: a bad input (`DataError`) or the end of its last epoch (`DataExhausted`)."""

from __future__ import annotations

from app.config_loader import ConfigError

__all__ = ["DataError", "DataExhausted"]


class DataError(ConfigError):
    """A task file or record that cannot be used; the message names the file, the line (or row) and the field."""


class DataExhausted(Exception):
    """Every record of the last epoch (`data.epochs`) has been used: the run ends cleanly."""
