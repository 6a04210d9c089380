"""A resumable stream of parsed records from local JSONL / Parquet files (torchdata.nodes).

    RecordSource (epoch order, rank's share, read + parse)  ->  Prefetcher (a background thread, `prefetch` ahead)
                                                                  ->  RecordStream (bad records, position, state)

The stream hands out records one by one, or with `group` = KEY whole units: lists of the records of one run of
consecutive lines with the same KEY (a rollout tree, `group` = "tree"; app.data.source.record_units). Shuffle,
epochs, rank shares, bad records and the state then count units.

Reading and parsing run on the prefetch thread; the training thread only takes finished units off its queue.
The stream tracks the position after the last unit it handed out (each unit carries it), so `state_dict()`
is exact however far the thread has read ahead, and `load_state_dict()` continues at the next unseen unit. The
state is plain JSON: {"epoch", "position", "skipped", "dataset"}, where "dataset" (file names and record counts,
the unit count when units are not single records, seed, shuffle, world) guards against resuming on other data.

`parse` turns a record dict into the value handed out and raises `rollout.envs.records.RecordError` to reject it;
a rejected or unreadable record is a DataError naming file, line and field, or (on_bad_record = "skip") skipped
with its whole unit and counted (`skipped` counts records). Any other reader plugs in through `parse` (task
records: an environment's task_from_record).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Generic, Literal, Sequence, TypeVar

from torchdata.nodes import Prefetcher

from app.data.files import open_record_files
from app.data.source import RecordSource
from app.errors import DataError

__all__ = ["RecordStream"]

T = TypeVar("T")


class RecordStream(Generic[T]):
    """Parsed records of `paths` (or with `group` lists of them, one per unit), in a seeded order, `epochs` passes
    (None: endless), this rank's share.

    Args:
        paths: .jsonl / .parquet files, read in this order before shuffling.
        parse: record dict -> value; raises RecordError to reject a record.
        seed, shuffle: the per-epoch permutation (app.data.source.epoch_order).
        epochs: passes over the data; after the last one iteration stops (StopIteration).
        rank, world: this reader's share: every world-th unit from `rank`, N // world per epoch.
        on_bad_record: "error" raises DataError; "skip" leaves out the record's unit, counts its records in
            `skipped` and calls `on_skip`.
        prefetch: units read ahead on a background thread (0: read on the caller's thread).
        on_skip: called with "file:line: reason" for each skipped unit.
        group: None (the unit is a record), or the key whose consecutive equal values make a unit (record_units).

    Raises:
        DataError: a file is missing or unreadable, a `group` value reappears non-consecutively in a file, or the
            files hold fewer than `world` units (none at all).
    """

    def __init__(self, paths: Sequence[str | Path], parse: Callable[[dict], T], *, seed: int = 0,
                 shuffle: bool = True, epochs: int | None = None, rank: int = 0, world: int = 1,
                 on_bad_record: Literal["error", "skip"] = "error", prefetch: int = 16,
                 on_skip: Callable[[str], None] | None = None, group: str | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"`rank` must lie in [0, world={world}), got {rank}")
        if seed < 0:
            raise ValueError(f"`seed` must be >= 0, got {seed}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"`epochs` must be >= 1 or None, got {epochs}")
        if on_bad_record not in ("error", "skip"):
            raise ValueError(f"`on_bad_record` must be 'error' or 'skip', got {on_bad_record!r}")
        if prefetch < 0:
            raise ValueError(f"`prefetch` must be >= 0, got {prefetch}")
        files = open_record_files(paths)
        self.source = RecordSource(files, parse, seed=seed, shuffle=shuffle, epochs=epochs, rank=rank, world=world,
                                   group=group)
        names = ", ".join(str(f.path) for f in files)
        if self.source.size == 0:
            raise DataError(f"no records in {names} (every line is blank)")
        units = f"{self.source.units} {group}s" if group else f"{self.source.size} records"
        if self.source.per_epoch == 0:
            raise DataError(f"{units} in {names} are fewer than the {world} ranks reading them")
        self.group = group
        self.on_bad_record = on_bad_record
        self.on_skip = on_skip
        self.prefetch = prefetch
        self.skipped = 0
        self._epoch = self._position = 0
        self._node = Prefetcher(self.source, prefetch) if prefetch else self.source
        self._fingerprint = {"files": [[f.path.name, len(f)] for f in files], "seed": seed, "shuffle": shuffle,
                             "world": world}
        if self.source.units != self.source.size:
            self._fingerprint["units"] = self.source.units

    @property
    def units_per_epoch(self) -> int:
        """Units (records, or `group` runs) this rank reads per epoch (bad ones included)."""
        return self.source.per_epoch

    @property
    def epochs(self) -> int | None:
        return self.source.epochs

    def __iter__(self) -> RecordStream[T]:
        return self

    def __next__(self) -> T:
        while True:
            item = next(self._node)
            self._epoch, self._position = item.epoch, item.position
            if item.error is None:
                return item.value if self.group else item.value[0]
            message = f"{item.where}: {item.error}"
            if self.on_bad_record == "error":
                raise DataError(f"{message}; fix the record or set data.on_bad_record = \"skip\"")
            self.skipped += item.size
            if item.size > 1:
                message += f" (with the other {item.size - 1} records of its {self.group})"
            if self.on_skip is not None:
                self.on_skip(message)

    def state_dict(self) -> dict[str, Any]:
        """Where the next unseen unit is (JSON-serialisable)."""
        return {"epoch": self._epoch, "position": self._position, "skipped": self.skipped,
                "dataset": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the unit after the last one handed out when `state` was taken.

        Raises:
            DataError: `state` belongs to other files, record counts, seed, shuffle or world size.
        """
        if state.get("dataset") != self._fingerprint:
            raise DataError(f"the checkpoint's data state is for {state.get('dataset')}, but this run reads "
                            f"{self._fingerprint}; resuming would not continue at the next unseen record: restore the "
                            "run's [data] files and settings, or start fresh without --resume")
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position < self.units_per_epoch:
            raise DataError(f"the checkpoint's data position {position} is outside an epoch of "
                            f"{self.units_per_epoch} units")
        self._epoch, self._position, self.skipped = epoch, position, int(state["skipped"])
        start = {"epoch": epoch, "position": position}
        # A Prefetcher restarts its thread from a snapshot of its source's state (torchdata's own format).
        self._node.reset({"snapshot": start, "steps_since_snapshot": 0} if self.prefetch else start)
