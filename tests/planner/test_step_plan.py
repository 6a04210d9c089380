"""planner.step_plan: the three planner modes, auto's per-tree choice, and the exact duplicate grouping."""

import itertools

import numpy as np
import pytest

from bench.workloads import swe_like_step
from planner.carry.plan import CarryPlan, SortedStep
from planner.carry.balance import Unit
from planner.microbatch.plan import MicrobatchPlan, plan_microbatches
from planner.pack import pack
from planner.step_plan import duplicate_groups, plan_step
from planner.trajectory import Trajectory
from tests.planner.test_carry import check_carry


def low_sharing_tree(rng, first: int) -> list[Trajectory]:
    """A 1-token prompt and six 63-token branches: duplicating repeats 1 row per microbatch of T = 64."""
    return [Trajectory(np.concatenate([[first], rng.integers(10, 99, size=63)])) for _ in range(6)]


def high_sharing_tree(rng, first: int) -> list[Trajectory]:
    """A 50-token prompt and six 3-token branches (68 rows): duplicating repeats the 50-row prompt."""
    prompt = np.concatenate([[first], rng.integers(10, 99, size=49)])
    return [Trajectory(np.concatenate([prompt, rng.integers(10, 99, size=3)])) for _ in range(6)]


def test_modes():
    rng = np.random.default_rng(0)
    trajectories = high_sharing_tree(rng, 1) + high_sharing_tree(rng, 2)
    duplicate = plan_step(trajectories, 64, 2, "duplicate")
    assert isinstance(duplicate, MicrobatchPlan)
    assert duplicate.to_json()["microbatches"] == plan_microbatches(trajectories, 64, 2).to_json()["microbatches"]
    carry = plan_step(trajectories, 64, 2, "carry")
    assert isinstance(carry, CarryPlan) and carry.total_compact_tokens == pack(trajectories).num_compact
    assert carry.total_compact_tokens < duplicate.total_compact_tokens
    with pytest.raises(ValueError, match="`mode` must be one of duplicate, carry, auto, got 'trie'"):
        plan_step(trajectories, 64, 2, "trie")


def test_auto_duplicates_when_sharing_is_small():
    """Alone, the low-sharing tree gets the duplicate plan; next to a high-sharing tree, auto carries only that."""
    rng = np.random.default_rng(1)
    low = low_sharing_tree(rng, 1)
    assert isinstance(plan_step(low, 64, 1, "auto"), MicrobatchPlan)
    trajectories = low + high_sharing_tree(rng, 2)
    plan = plan_step(trajectories, 64, 1, "auto")
    assert isinstance(plan, CarryPlan) and plan.method == "auto"
    check_carry(plan, trajectories, 64, 1)
    parts = {}
    for mb in plan.microbatches:
        for p in mb.parts:
            parts.setdefault(p.tree, []).append(p)
    for u, tree in enumerate(plan.trees):
        if max(tree) < len(low):
            assert len(parts[u]) == 1, "a duplicated group is never cut"
            assert pack([trajectories[i] for i in tree]).num_compact <= 64
        else:
            assert set(tree) == set(range(len(low), len(trajectories))) and len(parts[u]) > 1, "carried whole"
    assert plan.total_compact_tokens == plan.trie_compact_tokens + 5  # the low tree's prompt, 5 more times


@pytest.mark.parametrize("seed", range(6))
def test_duplicate_groups_are_the_fewest_rows(seed):
    """Exact against every contiguous grouping (brute force over cut sets)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 4, size=int(rng.integers(2, 8)))
    trajectories = [Trajectory(np.concatenate([prompt[: int(rng.integers(1, prompt.size + 1))],
                                               rng.integers(1, 4, size=int(rng.integers(1, 9)))])) for _ in range(7)]
    capacity = int(max(len(t) for t in trajectories) + rng.integers(0, 12))
    step = SortedStep.from_trajectories(trajectories)
    unit = Unit(0, len(trajectories), step.trie_rows, 0)
    groups = duplicate_groups(step, unit, capacity)

    def rows(a, b):
        return pack([trajectories[i] for i in step.order[a:b]]).num_compact

    n = len(trajectories)
    best = min(sum(rows(a, b) for a, b in zip((0, *cuts), (*cuts, n)))
               for k in range(n) for cuts in itertools.combinations(range(1, n), k)
               if all(rows(a, b) <= capacity for a, b in zip((0, *cuts), (*cuts, n))))
    assert [g.lo for g in groups][0] == 0 and groups[-1].hi == n
    assert all(g.rows == rows(g.lo, g.hi) <= capacity for g in groups)
    assert sum(g.rows for g in groups) == best
    long = Trajectory(np.arange(1, capacity + 2))
    assert duplicate_groups(SortedStep.from_trajectories([long]), Unit(0, 1, capacity + 1, 0), capacity) is None


def test_auto_plans_the_benchmarked_carry_step_as_carry():
    """`planner.mode = "auto"` (the default) is the mode that won `bench.speed` on its carry workload (SWE seed 5 at
    scale 0.01: carry 10.06 s against duplicate 14.08 s, bench/RESULTS.md session 7): there it plans carry's plan."""
    trajectories = swe_like_step(5, scale=0.01, vocab_size=157184, max_path_tokens=65536)
    auto, carry = plan_step(trajectories, 65536, 1, "auto"), plan_step(trajectories, 65536, 1, "carry")
    assert isinstance(auto, CarryPlan)
    assert auto.total_compact_tokens == carry.total_compact_tokens == pack(trajectories).num_compact
    assert [mb.compact_tokens for mb in auto.microbatches] == [mb.compact_tokens for mb in carry.microbatches]
