"""The torchdata node that reads records in epoch order: a seeded shuffle per epoch, dealt to ranks.

Epoch e of a dataset of N records (the files' records concatenated in path order) is a permutation of range(N)
drawn from numpy's PCG64 seeded with (seed, e), or the identity without shuffling. Rank r of W reads the epoch's
positions r, r + W, r + 2W, ..., cut to N // W records, so all ranks read equally many and stay in step (up to
W - 1 records of an epoch go unread; with shuffling a different few each epoch). The node's state is just
(epoch, position): the order is recomputed from the seed, so a state is valid on any rank of the same world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from torchdata.nodes import BaseNode

from app.data.files import RecordFile
from rollout.envs.records import RecordError

__all__ = ["epoch_order", "Item", "RecordSource"]


def epoch_order(size: int, epoch: int, *, seed: int, shuffle: bool, rank: int, world: int) -> np.ndarray:
    """[size // world] int64: the record indices rank `rank` reads in `epoch`, in order."""
    order = np.random.default_rng([seed, epoch]).permutation(size) if shuffle else np.arange(size)
    return order[rank::world][: size // world]


@dataclass(frozen=True)
class Item:
    """One record as read: its parsed value, or why it was rejected (`error`), where it is, and the (epoch,
    position) of the record after it."""

    where: str
    value: Any
    error: str | None
    epoch: int
    position: int


class RecordSource(BaseNode[Item]):
    """Records of `files` parsed by `parse` (which raises RecordError to reject one), `epochs` passes (None:
    endless). The state is {"epoch": int, "position": int}: the next record to read."""

    def __init__(self, files: Sequence[RecordFile], parse: Callable[[dict], Any], *, seed: int, shuffle: bool,
                 epochs: int | None, rank: int, world: int) -> None:
        super().__init__()
        self.files = list(files)
        self.parse = parse
        self.seed, self.shuffle, self.epochs, self.rank, self.world = seed, shuffle, epochs, rank, world
        self.starts = np.cumsum([0] + [len(f) for f in self.files])
        self.size = int(self.starts[-1])
        self.per_epoch = self.size // world
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
            self._order = (self._epoch, epoch_order(self.size, self._epoch, seed=self.seed, shuffle=self.shuffle,
                                                    rank=self.rank, world=self.world))
        index = int(self._order[1][self._position])
        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        file, row = self.files[k], index - int(self.starts[k])
        self._position += 1
        if self._position == self.per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
        try:
            value, error = self.parse(file.read(row)), None
        except RecordError as e:
            value, error = None, e.describe()
        return Item(file.where(row), value, error, self._epoch, self._position)

    def get_state(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}
