"""The RL job's tasks: the environment's own generator, or records of `[data] tasks` through a RecordStream.

The job asks for each step's tasks once, on the main rank (it rolls out every tree and shares them), so the stream
reads as rank 0 of a world of 1: sharding by data-parallel rank would hand the other ranks tasks no engine rolls
out. A checkpoint is written after a step completes, or after a step failed part-way (engine error, bad record):
`TaskFeed.state_dict(completed_steps)` gives the stream's state before the failed step's tasks, so --resume
draws that step's tasks again.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from app.config_loader import ConfigError
from app.data.config import DataConfig
from app.data.errors import DataExhausted
from app.data.stream import RecordStream
from rollout.envs import ChatEnvironment, Environment
from rollout.rendered_env import RenderedEnvironment

__all__ = ["TaskFeed", "build_task_feed"]

#: Skipped records printed one by one; after these they are only counted.
SKIPS_SHOWN = 10


class TaskFeed:
    """Tasks from `stream`, one batch per job step."""

    def __init__(self, stream: RecordStream) -> None:
        self.stream = stream
        self._before: tuple[int, dict[str, Any]] | None = None

    def tasks(self, count: int, step: int) -> list[Any]:
        """The `count` tasks of job step `step` (1-based, SFT and RL steps counted together).

        Raises:
            DataExhausted: fewer than `count` records are left in the last epoch.
            DataError: a bad record with data.on_bad_record = "error".
        """
        self._before = (step, self.stream.state_dict())
        tasks = list(itertools.islice(self.stream, count))
        if len(tasks) < count:
            raise DataExhausted(
                f"the {self.stream.epochs} epoch(s) of {self.stream.records_per_epoch} task records are used up: "
                f"step {step} needs {count} tasks, {len(tasks)} were left"
            )
        return tasks

    def state_dict(self, completed_steps: int) -> dict[str, Any]:
        """The stream's state after the tasks of steps 1..`completed_steps` (JSON-serialisable)."""
        if self._before is not None and self._before[0] > completed_steps:
            return self._before[1]
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def _inner(env: Environment) -> Environment | ChatEnvironment:
    return env.env if isinstance(env, RenderedEnvironment) else env


def build_task_feed(config: DataConfig, env: Environment, *, seed: int,
                    on_skip: Callable[[str], None] | None = None) -> TaskFeed | None:
    """The feed of `config.tasks` parsed by `env.task_from_record`, or None when `config.tasks` is unset (the job
    then calls `env.sample_tasks`).

    Args:
        seed: the shuffle seed when `config.seed` is unset (train.seed).
        on_skip: prints a skipped record's "file:line: reason" (the first SKIPS_SHOWN of them).

    Raises:
        ConfigError: no dataset for an environment without a generator, or a dataset for one that reads no records.
        DataError: the files cannot be read or hold no records.
    """
    inner = _inner(env)
    if config.tasks is None:
        if type(inner).sample_tasks is ChatEnvironment.sample_tasks:
            raise ConfigError(f"environment {env.name!r} has no task generator: set [data] tasks = \"PATH or glob\"")
        return None
    if type(inner).task_from_record in (Environment.task_from_record, ChatEnvironment.task_from_record):
        raise ConfigError(f"`data.tasks`: environment {env.name!r} does not read task records (it has no "
                          "task_from_record method); unset [data] tasks to use its generator")
    shown = itertools.count(1)

    def report(message: str) -> None:
        n = next(shown)
        if on_skip is not None and n <= SKIPS_SHOWN:
            more = "; further skipped records are only counted" if n == SKIPS_SHOWN else ""
            on_skip(f"data: skipped {message}{more}")

    stream = RecordStream(config.files(), env.task_from_record, seed=seed if config.seed is None else config.seed,
                          shuffle=config.shuffle, epochs=config.epochs, on_bad_record=config.on_bad_record,
                          prefetch=config.prefetch, on_skip=report)
    return TaskFeed(stream)
