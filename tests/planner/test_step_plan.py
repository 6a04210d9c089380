"""planner.step_plan: the three planner modes, auto's per-tree and per-microbatch (flat) choices, and the exact
duplicate grouping."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.workloads import swe_like_step
from planner.calls.plan import plan_calls
from planner.carry.balance import Unit
from planner.carry.plan import SortedStep
from planner.cost_model import CostModel
from planner.microbatch.flat import leaf_rows
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack
from planner.step_plan import duplicate_groups, longest_trajectory, plan_step
from planner.trajectory import Trajectory
from tests.planner.test_carry import check_carry
from tests.planner.trees import rollout_batches


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
    assert not duplicate.carries and not any(mb.flat for mb in duplicate.microbatches)
    assert duplicate.to_json()["microbatches"] == plan_microbatches(trajectories, 64, 2).to_json()["microbatches"]
    carry = plan_step(trajectories, 64, 2, "carry")
    assert carry.carries and carry.total_compact_tokens == pack(trajectories).num_compact
    assert carry.total_compact_tokens < duplicate.total_compact_tokens
    with pytest.raises(ValueError, match="`mode` must be one of duplicate, carry, auto, got 'trie'"):
        plan_step(trajectories, 64, 2, "trie")


def test_auto_duplicates_when_sharing_is_small():
    """Alone, the low-sharing tree gets the duplicate plan; next to a high-sharing tree, auto carries only that."""
    rng = np.random.default_rng(1)
    low = low_sharing_tree(rng, 1)
    assert not plan_step(low, 64, 1, "auto").carries
    trajectories = low + high_sharing_tree(rng, 2)
    plan = plan_step(trajectories, 64, 1, "auto")
    assert plan.carries and plan.method == "auto"
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
    scale 0.01: carry 10.06 s against duplicate 14.08 s, docs/history.md): there it plans carry's plan."""
    trajectories = swe_like_step(5, scale=0.01, vocab_size=157184, max_path_tokens=65536)
    auto, carry = plan_step(trajectories, 65536, 1, "auto"), plan_step(trajectories, 65536, 1, "carry")
    assert auto.carries
    assert auto.total_compact_tokens == carry.total_compact_tokens == pack(trajectories).num_compact
    assert [mb.compact_tokens for mb in auto.microbatches] == [mb.compact_tokens for mb in carry.microbatches]


def test_auto_marks_flat_microbatches_before_packing():
    """Auto mode's HARTS plan records per microbatch whether it runs flat (`CostModel.runs_flat` on the plan's
    numbers): a measured expansion cheaper than the trie sends a sharing microbatch flat if its tokens fit the
    capacity, the default cost model never does, and duplicate mode makes no such choice; the replica share carries
    the marks."""
    trajectories = high_sharing_tree(np.random.default_rng(2), 1)  # 6 paths of 53 tokens, 68 trie rows
    cheap = CostModel(expansion_per_token=0.0)
    flat = plan_step(trajectories, 400, 1, "auto", cost=cheap)
    assert not flat.carries and [mb.flat for mb in flat.microbatches] == [True]
    assert flat.replica(0).flat == (True,) and flat.to_json()["microbatches"][0]["flat"]
    assert [mb.flat for mb in plan_step(trajectories, 400, 1, "auto").microbatches] == [False]
    assert [mb.flat for mb in plan_step(trajectories, 300, 1, "auto", cost=cheap).microbatches] == [False]
    assert [mb.flat for mb in plan_step(trajectories, 400, 1, "duplicate", cost=cheap).microbatches] == [False]


@given(rollout_batches(max_trajectories=10, max_len=30), st.sampled_from([1, 2, 3, 16]))
def test_leaf_rows_are_the_view_rows_of_every_replay_plan(trajectories, chunk):
    """The view rows the flat choice uses (no call plan) equal the branch-view rows of the trie's replay plan."""
    batch = pack(trajectories)
    assert leaf_rows(trajectories) == plan_calls(batch, chunk).view_rows(batch.positions)


def test_longest_trajectory_is_the_capacity_in_duplicate_mode_only():
    """Duplicate mode runs every trajectory whole in one microbatch; carry and auto cut them."""
    assert longest_trajectory("duplicate", 64) == 64
    assert longest_trajectory("carry", 64) is None and longest_trajectory("auto", 64) is None
