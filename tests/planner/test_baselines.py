"""planner.microbatch.baselines: every peer planner returns a valid plan (coverage, capacity, K mod D, equal replica
counts)."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bench.workloads import swe_like_step
from planner.microbatch.baselines import BASELINES, areal_plan, ortools_plan
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.test_microbatch import check_plan
from tests.planner.trees import rollout_batches


def run(name, trajectories, capacity, dp):
    if name == "ortools":
        return ortools_plan(trajectories, capacity, dp, time_limit=0.5)
    return BASELINES[name](trajectories, capacity, dp)


def compact_work(plan, trajectories):
    return sum(pack([trajectories[i] for i in mb.trajectories]).num_compact for mb in plan.microbatches)


@pytest.mark.parametrize("name", list(BASELINES))
@settings(max_examples=40, deadline=None)
@given(trajectories=rollout_batches(max_trajectories=10, max_len=16), dp=st.integers(1, 3), slack=st.floats(0, 1))
def test_valid_plans(name, trajectories, dp, slack):
    assume(len(trajectories) >= 2 * dp)
    capacity = max(len(t) for t in trajectories) + int(slack * sum(len(t) for t in trajectories))
    try:
        plan = run(name, trajectories, capacity, dp)
    except ValueError as e:  # too few trajectories to give every replica the same number of microbatches
        assert "too few trajectories" in str(e) or "cannot be split" in str(e)
        return
    if name == "trajectory-wise":  # no sharing: work is the raw token count of each microbatch
        for mb in plan.microbatches:
            assert mb.compact_tokens == sum(len(trajectories[i]) for i in mb.trajectories) <= capacity
        mbs = plan.microbatches
        assert sorted(i for mb in mbs for i in mb.trajectories) == list(range(len(trajectories)))
        assert len(mbs) % dp == 0 and all(mb.trajectories for mb in mbs)
    else:
        check_plan(plan, trajectories, capacity, dp)


@pytest.mark.parametrize("name", list(BASELINES))
def test_generated_step(name):
    trajectories = swe_like_step(2, scale=0.2, token_scale=0.1)
    plan = run(name, trajectories, 6554, 4)
    if name != "trajectory-wise":
        check_plan(plan, trajectories, 6554, 4)
        assert plan.total_compact_tokens == compact_work(plan, trajectories)
    assert plan.planning_seconds > 0 and plan.method.startswith(name)


def test_areal_is_first_fit_in_partition_order():
    """balanced_greedy_partition: longest first to the replica with fewer tokens (2 per replica); then first-fit."""
    t = [Trajectory([1, 2, 3, 4, 5]), Trajectory([1, 2, 3, 9]), Trajectory([7, 8, 9]), Trajectory([1, 2, 6])]
    plan = areal_plan(t, capacity=7, dp=2)
    # Replica 0: 0 then 3 (shares [1, 2]: 5 + 1 = 6 tokens); replica 1: 1 then 2 (no sharing: 4 + 3 = 7 <= 7).
    assert sorted((mb.replica, mb.trajectories, mb.compact_tokens) for mb in plan.microbatches) == [
        (0, (0, 3), 6),
        (1, (1, 2), 7),
    ]
