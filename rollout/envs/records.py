"""Task records: one JSON object (a JSONL line) or Parquet row per task, turned into a task by its environment.

An environment reads the fields it needs with `required` and `optional` and raises `RecordError` naming the field
for anything else it rejects; the data pipeline (app.data) adds the file and line. Keys an environment does not read
are ignored, so records may carry ids and metadata.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["RecordError", "required", "optional"]

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
               dict: "an object"}


class RecordError(ValueError):
    """A task record an environment cannot use; `field` names the offending key (None: the record as a whole)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def describe(self) -> str:
        """The message with the field in front ("field 'answer': must be a string, got 3")."""
        return f"field {self.field!r}: {self}" if self.field is not None else str(self)


def _matches(value: Any, types: tuple[type, ...]) -> bool:
    # JSON booleans are Python ints: a bool only satisfies an explicit bool.
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types) or (float in types and isinstance(value, int))


def required(record: Mapping[str, Any], name: str, *types: type) -> Any:
    """`record[name]`, which must exist and be an instance of one of `types` (int counts as float)."""
    if name not in record or record[name] is None:
        raise RecordError("missing", field=name)
    return optional(record, name, *types)


def optional(record: Mapping[str, Any], name: str, *types: type, default: Any = None) -> Any:
    """`record[name]` if present and not null (checked like `required`), else `default`."""
    value = record.get(name)
    if value is None:
        return default
    if not _matches(value, types):
        wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
        raise RecordError(f"must be {wanted}, got {value!r} ({type(value).__name__})", field=name)
    return value
