"""The `[data]` section: where the job's records come from (task records of an RL job, trajectory records of an
offline job) and how they are read."""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from app.config_loader import PATH
from app.data.files import SUFFIXES
from app.errors import ConfigError

__all__ = ["DataConfig"]


@dataclass(kw_only=True)
class DataConfig:
    tasks: str | list[str] | None = field(default=None, metadata=PATH)
    """Task records: a .jsonl or .parquet file, a glob ("data/*.jsonl", "**" recurses) or a list of them, relative
    to the config file; files are read in sorted path order. Each record becomes a task through the environment's
    task_from_record (its fields: the environment's docstring). Unset: the environment's own task generator."""
    trajectories: str | list[str] | None = field(default=None, metadata=PATH)
    """`[job] kind = "offline"` only: TRAJ.jsonl files (one trajectory per line, planner/jsonl.py), a glob or a list
    of them, as for `tasks`. The paths of one recorded tree share a `tree` id and must be consecutive lines of one
    file (an id that reappears later in its file is an error); shuffle, epochs and skipped records then move whole
    trees, and `train.trees_per_step` trees make a step (`train.trajectories_per_step` records without trees)."""
    shuffle: bool = True
    """Shuffle the records anew every epoch (seeded); false reads them in file order."""
    seed: int | None = None
    """Seed of the shuffle (>= 0); unset = `train.seed`."""
    epochs: int | None = None
    """Passes over the records; unset = as many as the run needs. After the last one the run stops cleanly (final
    checkpoint and export); raise it and --resume to go on."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A record that cannot be read or lacks a field: "error" stops with file, line and field (after saving a
    checkpoint); "skip" leaves it out, with the rest of its tree for trajectories, and counts the records left out
    (the checkpoint's data state holds the count)."""
    prefetch: int = 16
    """Records read and parsed ahead on a background thread; 0 = on the training thread."""

    def __post_init__(self) -> None:
        for key in ("tasks", "trajectories"):
            value = getattr(self, key)
            if isinstance(value, list) and not value:
                raise ConfigError(f"`data.{key}` must name at least one file or glob, or be left unset")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"`data.seed` must be >= 0 or unset, got {self.seed}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"`data.epochs` must be >= 1 or unset, got {self.epochs}")
        if self.prefetch < 0:
            raise ConfigError(f"`data.prefetch` must be >= 0 (0 = no background thread), got {self.prefetch}")
        if self.tasks is not None and self.trajectories is not None:
            raise ConfigError("`data.tasks` and `data.trajectories` are both set: an RL job reads tasks, an offline "
                              "job trajectories; remove one")
        if self.tasks is not None:
            self.files()
        if self.trajectories is not None:
            self.files("trajectories")

    def files(self, key: Literal["tasks", "trajectories"] = "tasks") -> list[Path]:
        """The record files the patterns of `data.<key>` match, sorted, each once."""
        value = getattr(self, key)
        patterns = [value] if isinstance(value, str) else list(value or [])
        suffixes = SUFFIXES if key == "tasks" else (".jsonl",)
        found: list[Path] = []
        for pattern in patterns:
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise ConfigError(f"`data.{key}`: {pattern!r} matches no file")
            for path in matches:
                if path.suffix not in suffixes:
                    raise ConfigError(f"`data.{key}`: {path} is neither {' nor '.join(suffixes)}"
                                      if len(suffixes) > 1 else f"`data.{key}`: {path} is not a {suffixes[0]} file")
                if path not in found:
                    found.append(path)
        return sorted(found)
