"""Record files on local disk, read one record at a time by index: JSONL (one JSON object per non-blank line) and
Parquet (one record per row, through pyarrow)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from app.errors import DataError
from rollout.envs.records import RecordError

__all__ = ["RecordFile", "JsonlFile", "ParquetFile", "open_record_files", "SUFFIXES", "UNREADABLE"]

SUFFIXES = (".jsonl", ".parquet")

#: What `RecordFile.values` gives for a record that is no JSON object.
UNREADABLE = object()


class RecordFile(ABC):
    """The records of one file; `read` may run on a prefetch thread."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def where(self, index: int) -> str:
        """Where record `index` is, for messages ("tasks.jsonl:12", "tasks.parquet, row 11")."""

    @abstractmethod
    def read(self, index: int) -> dict[str, Any]:
        """Record `index` as a dict; raises RecordError for an unreadable one."""

    @abstractmethod
    def values(self, key: str) -> list[Any]:
        """Every record's value of `key` in file order (None where it lacks the key, UNREADABLE where the record is
        no JSON object); reads the whole file."""


class JsonlFile(RecordFile):
    """JSON lines, indexed once by the byte offset of every non-blank line (blank lines are not records)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        offsets, lines, offset = [], [], 0
        try:
            with path.open("rb") as f:
                for number, line in enumerate(f, start=1):
                    if line.strip():
                        offsets.append(offset)
                        lines.append(number)
                    offset += len(line)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lines = np.asarray(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, index: int) -> str:
        return f"{self.path}:{self.lines[index]}"

    def read(self, index: int) -> dict[str, Any]:
        # A fresh handle per read: a resumed stream's new prefetch thread may overlap the old one's last read.
        with self.path.open("rb") as f:
            f.seek(int(self.offsets[index]))
            raw = f.readline()
        return self._decode(raw)

    def values(self, key: str) -> list[Any]:
        found = []
        with self.path.open("rb") as f:
            for offset in self.offsets:
                f.seek(int(offset))
                try:
                    found.append(self._decode(f.readline()).get(key))
                except RecordError:
                    found.append(UNREADABLE)
        return found

    @staticmethod
    def _decode(raw: bytes) -> dict[str, Any]:
        try:
            value = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RecordError(f"unreadable line: not UTF-8 ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise RecordError(f"unreadable line: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, dict):
            raise RecordError(f"expected a JSON object, got {type(value).__name__}")
        return value


class ParquetFile(RecordFile):
    """Parquet rows as dicts (column name -> Python value). The row count comes from the footer; the table is
    loaded, memory-mapped, on the first read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        self._pq = pq
        try:
            self.rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        self._table = None

    def __len__(self) -> int:
        return self.rows

    def where(self, index: int) -> str:
        return f"{self.path}, row {index}"

    def read(self, index: int) -> dict[str, Any]:
        if self._table is None:
            self._table = self._pq.read_table(self.path, memory_map=True)
        return self._table.slice(index, 1).to_pylist()[0]

    def values(self, key: str) -> list[Any]:
        if self._table is None:
            self._table = self._pq.read_table(self.path, memory_map=True)
        if key not in self._table.column_names:
            return [None] * self.rows
        return self._table.column(key).to_pylist()


def open_record_files(paths: Sequence[str | Path]) -> list[RecordFile]:
    """One RecordFile per path, by suffix (.jsonl or .parquet)."""
    files: list[RecordFile] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        if path.suffix == ".jsonl":
            files.append(JsonlFile(path))
        elif path.suffix == ".parquet":
            files.append(ParquetFile(path))
        else:
            raise DataError(f"{path}: unknown record format {path.suffix!r} (use {' or '.join(SUFFIXES)})")
    return files
