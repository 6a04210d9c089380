"""planner.microbatch.plan: guarantees of every returned plan, eq. 5 against a trie count, errors."""

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.lcp_index import LcpIndex
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.trees import rollout_batches


def check_plan(plan, trajectories, capacity, dp):
    """Every guarantee of planner.microbatch.plan, with work recounted by an independent trie (planner.pack)."""
    mbs = plan.microbatches
    covered = sorted(i for mb in mbs for i in mb.trajectories)
    assert covered == list(range(len(trajectories))), "exact coverage"
    assert len(mbs) % dp == 0 and len(mbs) >= dp
    per_replica = len(mbs) // dp
    for mb in mbs:
        assert mb.trajectories, "nonempty"
        assert list(mb.trajectories) == sorted(mb.trajectories)
        assert mb.compact_tokens == pack([trajectories[i] for i in mb.trajectories]).num_compact  # eq. 5
        assert mb.compact_tokens <= capacity
        assert 0 <= mb.replica < dp and 0 <= mb.slot < per_replica
    assert sorted((mb.replica, mb.slot) for mb in mbs) == [(d, j) for d in range(dp) for j in range(per_replica)]
    assert [(mb.slot, mb.replica) for mb in mbs] == sorted((mb.slot, mb.replica) for mb in mbs)
    w = plan.slot_work()
    assert plan.objective() == (w.sum(), w.max(axis=1).sum(), w.sum(axis=0).max(), plan.num_slots)
    assert plan.total_compact_tokens == w.sum()


def contiguous_plan_exists(trajectories, capacity, dp):
    """Brute force: is there a partition of the lexicographic order into a multiple of dp capacity-feasible ranges?"""
    index = LcpIndex.from_trajectories(trajectories)
    n = index.size
    for k in range(dp, n + 1, dp):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            if all(index.interval_work(a, b - 1) <= capacity for a, b in zip(bounds, bounds[1:])):
                return True
    return False


@settings(max_examples=120, deadline=None)
@given(rollout_batches(max_trajectories=9, max_len=20), st.integers(1, 4), st.floats(0.0, 1.2), st.booleans())
def test_guarantees(trajectories, dp, slack, evolution):
    """Random capacity between the longest trajectory and the whole trie; both the exact-DP and evolution paths."""
    assume(len(trajectories) >= dp)
    longest = max(len(t) for t in trajectories)
    capacity = longest + int(slack * pack(trajectories).num_compact)
    options = {"exact_cells": 0} if evolution else {}
    try:
        plan = plan_microbatches(trajectories, capacity, dp, **options)
    except ValueError as e:
        assert "no plan" in str(e)
        assert evolution or not contiguous_plan_exists(trajectories, capacity, dp)
        return
    check_plan(plan, trajectories, capacity, dp)
    assert plan.planning_seconds > 0


@settings(max_examples=40, deadline=None)
@given(rollout_batches(max_trajectories=8, max_len=16), st.integers(1, 3))
def test_greedy_candidate_never_hurts(trajectories, dp):
    """With the greedy candidate disabled the plan is still valid and never better than with it (same search + more)."""
    assume(len(trajectories) >= dp)
    capacity = max(len(t) for t in trajectories) + 6
    try:
        full = plan_microbatches(trajectories, capacity, dp)
    except ValueError:
        return
    try:
        without = plan_microbatches(trajectories, capacity, dp, greedy_max_n=0)
    except ValueError:
        return  # the contiguous/refined search alone can miss a plan of K = multiple of dp that greedy finds
    check_plan(without, trajectories, capacity, dp)
    assert full.objective() <= without.objective()


def test_single_tree_walkthrough():
    A, B, C, D, E, F, G = 10, 11, 12, 13, 14, 15, 16
    trajectories = [Trajectory([A, B, C, D]), Trajectory([A, B, C, E]), Trajectory([A, B, F, G])]
    plan = plan_microbatches(trajectories, capacity=7, dp=1)
    assert len(plan.microbatches) == 1 and plan.total_compact_tokens == 7
    plan = plan_microbatches(trajectories, capacity=6, dp=1)  # the trie (7) does not fit: cut at the shallow fork
    assert plan.total_compact_tokens == 5 + 4
    assert sorted(mb.trajectories for mb in plan.microbatches) == [(0, 1), (2,)]
    plan = plan_microbatches(trajectories, capacity=7, dp=2)  # two replicas: cheapest cut again
    assert plan.objective() == (9, 5, 5, plan.num_slots)
    check_plan(plan, trajectories, 7, 2)


def test_prefers_sharing_over_balance():
    """Eq. 4 is lexicographic: total work first, even when a heavier slot results."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, size=50)
    trajectories = [Trajectory(np.concatenate([prompt, rng.integers(0, 1000, size=5)])) for _ in range(4)]
    trajectories += [Trajectory(rng.integers(0, 1000, size=20)) for _ in range(4)]
    plan = plan_microbatches(trajectories, capacity=200, dp=2)
    check_plan(plan, trajectories, 200, 2)
    assert plan.total_compact_tokens == 50 + 4 * 5 + 4 * 20  # the prompt is computed once


@pytest.mark.parametrize(
    "trajectories, capacity, dp, error, message",
    [
        ([], 10, 1, ValueError, "empty"),
        ([Trajectory([1, 2, 3])], 10, 0, ValueError, "`dp` must be >= 1, got 0"),
        ([Trajectory([1, 2, 3])], 0, 1, ValueError, "`capacity` must be >= 1, got 0"),
        ([Trajectory([1, 2, 3])], 10, 1.5, TypeError, "`dp` must be an int"),
        ([Trajectory([1, 2, 3])], 10, 2, ValueError, "dp=2 replicas need at least 2 trajectories"),
        ([[1, 2]], 10, 1, TypeError, r"trajectories\[0\] must be a planner.Trajectory"),
        (
            [Trajectory([1, 2]), Trajectory(list(range(12))), Trajectory(list(range(30)))],
            10,
            1,
            ValueError,
            "trajectory 1 has 12 tokens but capacity is 10 .* 2 trajectories are too long, the longest has 30 tokens: "
            "use capacity >= 30",
        ),
        ([Trajectory([1, 2, 3]), Trajectory([4, 5, 6])], 3, 4, ValueError, "dp=4"),
    ],
)
def test_errors(trajectories, capacity, dp, error, message):
    with pytest.raises(error, match=message):
        plan_microbatches(trajectories, capacity, dp)


def test_no_plan_error():
    """Three trajectories that each fill a microbatch cannot make a multiple of dp=2 nonempty microbatches."""
    trajectories = [Trajectory([1, 2, 3]), Trajectory([4, 5, 6]), Trajectory([7, 8, 9])]
    with pytest.raises(ValueError, match="no plan with a multiple of dp=2 nonempty microbatches"):
        plan_microbatches(trajectories, capacity=3, dp=2)


def test_json_shape():
    trajectories = [Trajectory([1, 2, 3]), Trajectory([1, 2, 4]), Trajectory([5, 6])]
    out = plan_microbatches(trajectories, capacity=4, dp=2).to_json()
    assert set(out) == {"microbatches", "total_compact_tokens", "planning_seconds"}
    assert all(set(mb) == {"trajectories", "replica", "slot", "compact_tokens", "flat"} for mb in out["microbatches"])
    assert out["total_compact_tokens"] == sum(mb["compact_tokens"] for mb in out["microbatches"])


def test_ties_prefer_fewer_microbatches():
    """Trees that share nothing cost the same work together or apart; with room for all, one microbatch is chosen."""
    rng = np.random.default_rng(0)
    trajs = []
    for tree in range(4):
        prompt = rng.integers(1, 100, size=40)
        tails = [rng.integers(1, 100, size=60) for _ in range(2)]
        trajs += [Trajectory(np.concatenate([prompt, tail]), tree=f"t{tree}") for tail in tails]
    plan = plan_microbatches(trajs, capacity=10_000, dp=1)
    assert plan.num_slots == 1 and plan.microbatches[0].compact_tokens == pack(trajs).num_compact
