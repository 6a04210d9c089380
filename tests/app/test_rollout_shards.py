"""Engines of a torchrun job: groups of consecutive ranks, contiguous blocks of whole trees that tile every step's
tasks exactly once, and per-engine seeds that depend on the step and the engine only."""

from __future__ import annotations

import pytest

from app.rollout_shards import EngineShard, engine_shard, rollout_seed, task_range


@pytest.mark.parametrize("tasks", [0, 1, 3, 8, 13])
@pytest.mark.parametrize("engines", [1, 2, 3, 8])
def test_task_blocks_tile_the_step_once_in_order(tasks, engines):
    blocks = [task_range(tasks, e, engines) for e in range(engines)]
    assert [i for block in blocks for i in block] == list(range(tasks))
    sizes = [len(block) for block in blocks]
    assert max(sizes) - min(sizes) <= 1, sizes


def test_engine_groups_are_consecutive_ranks():
    assert [engine_shard(rank, 8, 2) for rank in (0, 1, 6, 7)] == [
        EngineShard(0, 4, True), EngineShard(0, 4, False), EngineShard(3, 4, True), EngineShard(3, 4, False)]
    assert engine_shard(0, 1, 1) == EngineShard(0, 1, True)
    with pytest.raises(ValueError, match=r"`rollout.vllm.tensor_parallel_size` = 3 must divide the job's 8 ranks"):
        engine_shard(0, 8, 3)


def test_rollout_seeds_depend_on_the_seeds_the_step_and_the_engine():
    seeds = {rollout_seed(t, e, s, k) for t in (0, 1) for e in (0, 1) for s in range(4) for k in range(4)}
    assert len(seeds) == 2 * 2 * 4 * 4
    assert rollout_seed(3, 0, 5, 1) == rollout_seed(3, 0, 5, 1)
