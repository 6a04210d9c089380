"""A job's records (or the units of a grouped stream: whole trees) in step-sized batches from a RecordStream, with
the stream state of the last completed step.

The job asks for each step's records once, on the main rank (it plans the step for every data-parallel replica and
shares the plan), so the stream reads as rank 0 of a world of 1: its state does not depend on the number of ranks,
and a run moves between one process and N ranks at the same record. A checkpoint is written after a step completes,
or after a step failed part-way (engine error, bad record): `RecordFeed.state_dict(completed_steps)` gives the
stream's state before the failed step's records, so --resume draws that step's records again.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Literal

from app.data.config import DataConfig
from app.data.errors import DataExhausted
from app.data.stream import RecordStream

__all__ = ["RecordFeed", "open_stream", "SKIPS_SHOWN"]

#: Skipped records printed one by one; after these they are only counted.
SKIPS_SHOWN = 10


class RecordFeed:
    """Records from `stream`, one batch per job step; `records` and `items` name them in messages ("task records",
    "tasks")."""

    def __init__(self, stream: RecordStream, records: str = "task records", items: str = "tasks") -> None:
        self.stream = stream
        self.records, self.items = records, items
        self._before: tuple[int, dict[str, Any]] | None = None

    def next_batch(self, count: int, step: int) -> list[Any]:
        """The `count` records (units) of job step `step` (1-based, every phase's steps counted together).

        Raises:
            DataExhausted: fewer than `count` units are left in the last epoch.
            DataError: a bad record with data.on_bad_record = "error".
        """
        self._before = (step, self.stream.state_dict())
        batch = list(itertools.islice(self.stream, count))
        if len(batch) < count:
            raise DataExhausted(
                f"the {self.stream.epochs} epoch(s) of {self.stream.units_per_epoch} {self.records} are used up: "
                f"step {step} needs {count} {self.items}, {len(batch)} were left"
            )
        return batch

    def state_dict(self, completed_steps: int) -> dict[str, Any]:
        """The stream's state after the records of steps 1..`completed_steps` (JSON-serialisable)."""
        if self._before is not None and self._before[0] > completed_steps:
            return self._before[1]
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def open_stream(config: DataConfig, key: Literal["tasks", "trajectories"], parse: Callable[[dict], Any], *, seed: int,
                on_skip: Callable[[str], None] | None, group: str | None = None) -> RecordStream:
    """The stream of the files of `data.<key>` parsed by `parse`, read as `config` says (shuffle, epochs, bad
    records, prefetch), in units of `group` (RecordStream) when set.

    Args:
        seed: the shuffle seed when `config.seed` is unset (train.seed).
        on_skip: prints a skipped record's "data: skipped FILE:LINE: reason" (the first SKIPS_SHOWN of them).

    Raises:
        DataError: the files cannot be read, hold no records, or a `group` value reappears non-consecutively.
    """
    shown = itertools.count(1)

    def report(message: str) -> None:
        n = next(shown)
        if on_skip is not None and n <= SKIPS_SHOWN:
            more = "; further skipped records are only counted" if n == SKIPS_SHOWN else ""
            on_skip(f"data: skipped {message}{more}")

    return RecordStream(config.files(key), parse, seed=seed if config.seed is None else config.seed,
                        shuffle=config.shuffle, epochs=config.epochs, on_bad_record=config.on_bad_record,
                        prefetch=config.prefetch, on_skip=report, group=group)
