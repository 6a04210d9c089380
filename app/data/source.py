"""The torchdata node that reads records in epoch order: a seeded shuffle per epoch, dealt to ranks.

The node reads units: single records, or with `group` = KEY the maximal runs of consecutive records of one file
with the same KEY value (a rollout tree's paths, `group` = "tree"; `record_units`). Epoch e of a dataset of N units
(the files' units concatenated in path order) is a permutation of range(N) drawn from numpy's PCG64 seeded with
(seed, e), or the identity without shuffling. Rank r of W reads the epoch's positions r, r + W, r + 2W, ..., cut to
N // W units, so all ranks read equally many and stay in step (up to W - 1 units of an epoch go unread; with
shuffling a different few each epoch). The node's state is just (epoch, position): the order is recomputed from the
seed, so a state is valid on any rank of the same world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from torchdata.nodes import BaseNode

from app.data.files import UNREADABLE, RecordFile
from app.errors import DataError
from rollout.envs.records import RecordError

__all__ = ["epoch_order", "record_units", "Item", "RecordSource"]


def record_units(files: Sequence[RecordFile], key: str) -> np.ndarray:
    """[U + 1] int64: where each unit starts in the files' concatenated records, then the record count.

    A unit is a maximal run of consecutive records of one file whose `key` is the same string or integer; a record
    without one (missing, null, another type) is a unit of its own, and a record that is no JSON object belongs to
    the unit of the record before it if that one has a `key` value (a corrupt line inside a tree spoils that tree),
    else is a unit of its own.

    Raises:
        DataError: a `key` value starts a second run in the same file (naming both lines).
    """
    starts, base = [], 0
    for file in files:
        begun: dict[tuple[str, str | int], int] = {}
        previous = None
        for row, value in enumerate(file.values(key)):
            if value is UNREADABLE:
                if row == 0 or previous is None:
                    starts.append(base + row)
                continue
            keyed = isinstance(value, (str, int)) and not isinstance(value, bool)
            ident = (type(value).__name__, value) if keyed else None
            if row == 0 or ident is None or ident != previous:
                if ident in begun:
                    raise DataError(f"{file.where(row)}: {key} {value!r} reappears after other records (it began at "
                                    f"{file.where(begun[ident])}): the records of one {key} must be consecutive lines "
                                    f"of one file; move them together or give them another {key} id")
                if ident is not None:
                    begun[ident] = row
                starts.append(base + row)
            previous = ident
        base += len(file)
    return np.asarray(starts + [base], dtype=np.int64)


def epoch_order(size: int, epoch: int, *, seed: int, shuffle: bool, rank: int, world: int) -> np.ndarray:
    """[size // world] int64: the record indices rank `rank` reads in `epoch`, in order."""
    order = np.random.default_rng([seed, epoch]).permutation(size) if shuffle else np.arange(size)
    return order[rank::world][: size // world]


@dataclass(frozen=True)
class Item:
    """One unit as read: its records' parsed values, or why its first bad record was rejected (`error`, `where`
    that record is), its record count `size`, and the (epoch, position) of the unit after it."""

    where: str
    value: list[Any] | None
    error: str | None
    size: int
    epoch: int
    position: int


class RecordSource(BaseNode[Item]):
    """Units of `files` (records, or with `group` the runs of `record_units`) parsed by `parse` (which raises
    RecordError to reject a record, and so its unit), `epochs` passes (None: endless). The state is
    {"epoch": int, "position": int}: the next unit to read."""

    def __init__(self, files: Sequence[RecordFile], parse: Callable[[dict], Any], *, seed: int, shuffle: bool,
                 epochs: int | None, rank: int, world: int, group: str | None = None) -> None:
        super().__init__()
        self.files = list(files)
        self.parse = parse
        self.seed, self.shuffle, self.epochs, self.rank, self.world = seed, shuffle, epochs, rank, world
        self.starts = np.cumsum([0] + [len(f) for f in self.files])
        self.size = int(self.starts[-1])
        self.bounds = record_units(self.files, group) if group else np.arange(self.size + 1)
        self.units = len(self.bounds) - 1
        self.per_epoch = self.units // world
        self._epoch = self._position = 0
        self._order: tuple[int, np.ndarray] | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        state = initial_state or {"epoch": 0, "position": 0}
        self._epoch, self._position = int(state["epoch"]), int(state["position"])

    def next(self) -> Item:
        if self.epochs is not None and self._epoch >= self.epochs:
            raise StopIteration
        if self._order is None or self._order[0] != self._epoch:
            self._order = (self._epoch, epoch_order(self.units, self._epoch, seed=self.seed, shuffle=self.shuffle,
                                                    rank=self.rank, world=self.world))
        file, rows = self.rows(int(self._order[1][self._position]))
        self._position += 1
        if self._position == self.per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
        values = []
        for row in rows:
            try:
                values.append(self.parse(file.read(row)))
            except RecordError as e:
                return Item(file.where(row), None, e.describe(), len(rows), self._epoch, self._position)
        return Item(file.where(rows[0]), values, None, len(rows), self._epoch, self._position)

    def rows(self, unit: int) -> tuple[RecordFile, range]:
        """The file of unit `unit` and its records' rows in that file."""
        first, end = int(self.bounds[unit]), int(self.bounds[unit + 1])
        k = int(np.searchsorted(self.starts, first, side="right")) - 1
        return self.files[k], range(first - int(self.starts[k]), end - int(self.starts[k]))

    def get_state(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}
