"""Which engine a rank belongs to, which of a step's trees each engine rolls out, and with which seed.

Under torchrun every group of `ranks_per_engine` consecutive ranks runs one engine (vLLM: tensor parallel over the
group; the torch engine: one rank); in one process there is one engine. A step's tasks are split into contiguous
blocks of whole trees, one block per engine, as even as the count allows: all branches of a tree decode on one
engine (its prefix cache serves them), and a tree keeps its step-wide index in its id, so the trees gathered in
engine order are the step's trees in task order, as one engine would list them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

__all__ = ["EngineShard", "engine_shard", "task_range", "rollout_seed"]


@dataclass(frozen=True)
class EngineShard:
    """This rank's place among the job's engines."""

    index: int
    """The engine this rank serves, 0 .. count - 1."""
    count: int
    """Engines of the job."""
    leader: bool
    """The first rank of the engine's group: its trees are the engine's (the other ranks of a tensor-parallel group
    build the same trees in step with it)."""


def engine_shard(rank: int, world_size: int, ranks_per_engine: int) -> EngineShard:
    """The engine of `rank` of `world_size` ranks, in groups of `ranks_per_engine` consecutive ranks."""
    if ranks_per_engine < 1 or world_size % ranks_per_engine:
        raise ValueError(f"`rollout.vllm.tensor_parallel_size` = {ranks_per_engine} must divide the job's "
                         f"{world_size} ranks")
    return EngineShard(rank // ranks_per_engine, world_size // ranks_per_engine, rank % ranks_per_engine == 0)


def task_range(tasks: int, engine: int, engines: int) -> range:
    """The step's task indices that engine `engine` of `engines` rolls out: a contiguous block; block sizes differ by
    at most one (an engine gets none when there are fewer tasks than engines)."""
    return range(engine * tasks // engines, (engine + 1) * tasks // engines)


def rollout_seed(train_seed: int, engine_seed: int, step: int, engine: int) -> int:
    """The seed engine `engine` restarts its sampling from at RL step `step` (0-based): a function of the job's seeds,
    the step and the engine alone, so a resumed run samples the step again as the first run did."""
    return zlib.crc32(f"{train_seed}/{engine_seed}/rl/{step}/{engine}".encode())
