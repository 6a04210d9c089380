"""The RL job's tasks: the environment's own generator, or records of `[data] tasks` through a RecordFeed
(app.data.feed: read on the main rank, the state of the last completed step in every checkpoint)."""

from __future__ import annotations

from typing import Any, Callable

from app.data.config import DataConfig
from app.data.feed import RecordFeed, open_stream
from app.errors import ConfigError
from rollout.envs import ChatEnvironment, Environment
from rollout.rendered_env import RenderedEnvironment

__all__ = ["TaskFeed", "build_task_feed"]


class TaskFeed(RecordFeed):
    """Tasks from a stream of task records, one batch per job step."""

    def tasks(self, count: int, step: int) -> list[Any]:
        """The `count` tasks of job step `step` (RecordFeed.next_batch)."""
        return self.next_batch(count, step)


def _inner(env: Environment) -> Environment | ChatEnvironment:
    return env.env if isinstance(env, RenderedEnvironment) else env


def build_task_feed(config: DataConfig, env: Environment, *, seed: int,
                    on_skip: Callable[[str], None] | None = None) -> TaskFeed | None:
    """The feed of `config.tasks` parsed by `env.task_from_record`, or None when `config.tasks` is unset (the job
    then calls `env.sample_tasks`).

    Args:
        seed: the shuffle seed when `config.seed` is unset (train.seed).
        on_skip: prints a skipped record (the first app.data.feed.SKIPS_SHOWN of them).

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
    return TaskFeed(open_stream(config, "tasks", env.task_from_record, seed=seed, on_skip=on_skip))
