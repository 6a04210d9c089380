"""planner.carry.plan: every guarantee of a carry plan, with rows, contexts and reads recounted by planner.pack."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.carry.balance import Unit
from planner.carry.plan import ContextSizes, SortedStep, plan_carry
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.trees import rollout_batches


def ancestors(batch, row: int) -> set[int]:
    """Rows above `row` by pack's parent pointers (an independent walk, one row at a time)."""
    out = set()
    r = int(batch.parent[row])
    while r >= 0:
        out.add(r)
        r = int(batch.parent[r])
    return out


def check_carry(plan, trajectories, capacity, dp):
    assert sorted(i for tree in plan.trees for i in tree) == list(range(len(trajectories))), "trees partition"
    batches = [pack([trajectories[i] for i in tree]) for tree in plan.trees]
    assert plan.trie_compact_tokens == pack(trajectories).num_compact
    assert plan.total_compact_tokens == sum(b.num_compact for b in batches), "executed rows = the trees' rows"
    where = {}  # (tree, start) -> (replica, slot, stop)
    for mb in plan.microbatches:
        assert 0 <= mb.replica < dp and mb.parts
        assert mb.compact_tokens == sum(p.stop - p.start for p in mb.parts) <= capacity
        for p in mb.parts:
            where[p.tree, p.start] = (mb.replica, mb.slot, p.stop)
    assert len({(mb.replica, mb.slot) for mb in plan.microbatches}) == len(plan.microbatches)
    slot_of = {}
    for u, batch in enumerate(batches):
        parts = sorted((start, *where[t, start]) for t, start in where if t == u)
        assert parts[0][0] == 0 and all(a[3] == b[0] for a, b in zip(parts, parts[1:])), "parts tile the rows"
        assert parts[-1][3] == batch.num_compact, "every row in exactly one part"
        assert len({r for _, r, _, _ in parts}) == 1, "one replica per tree"
        slots = [s for _, _, s, _ in parts]
        assert slots == sorted(set(slots)), "increasing slots"
        for start, _, s, stop in parts:
            slot_of.update({(u, r): s for r in range(start, stop)})
    for mb in plan.microbatches:
        reads, exported = set(), set()
        for p in mb.parts:
            batch = batches[p.tree]
            context = ancestors(batch, p.start)
            assert p.context_rows == len(context) == batch.positions[p.start], "context = root path of the start"
            assert all(slot_of[p.tree, r] < mb.slot for r in context)
            reads |= {slot_of[p.tree, r] for r in context}
            rows = np.arange(p.start, p.stop)
            entry = rows[(batch.parent[rows] >= 0) & (batch.parent[rows] < p.start)]
            assert list(p.entries) == batch.positions[entry].tolist()
        for later in plan.microbatches:
            if later.replica == mb.replica and later.slot > mb.slot:
                for p in later.parts:
                    exported |= {(p.tree, r) for r in ancestors(batches[p.tree], p.start)
                                 if slot_of[p.tree, r] == mb.slot}
        assert mb.exported_rows == len(exported)
        assert mb.reads == tuple(sorted(reads))
    check_events(plan)


def check_events(plan):
    kinds = [[k for k, _ in events] for events in plan.events]
    assert all(k == kinds[0] for k in kinds), "every replica runs the same kinds"
    for d, events in enumerate(plan.events):
        mine = {mb.slot: mb for mb in plan.microbatches if mb.replica == d}
        forwards = [s for k, s in events if k == "forward" and s >= 0]
        backwards = [s for k, s in events if k == "backward" and s >= 0]
        assert forwards == sorted(mine) and sorted(backwards) == sorted(mine)
        when = {("backward", s): i for i, (k, s) in enumerate(events) if k == "backward" and s >= 0}
        when.update({("forward", s): i for i, (k, s) in enumerate(events) if k == "forward" and s >= 0})
        open_ = 0
        for k, s in events:
            if s >= 0:
                open_ += 1 if k == "forward" else -1
                assert open_ <= plan.max_open_microbatches
        for s, mb in mine.items():
            assert when["forward", s] < when["backward", s]
            for r in mb.reads:
                assert when["backward", s] < when["backward", r], "backward after every reader"


@settings(max_examples=150, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=30), st.integers(1, 3), st.integers(1, 40))
def test_guarantees(trajectories, dp, capacity):
    """Any capacity, also below the longest trajectory; every row once, contexts and reads as pack's trie says."""
    check_carry(plan_carry(trajectories, capacity, dp), trajectories, capacity, dp)


@settings(max_examples=60, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=30), st.integers(1, 40))
def test_unit_rows_match_pack(trajectories, capacity):
    """Row arithmetic from the sorted order and LCPs = pack's positions, parents and root paths, row by row."""
    step = SortedStep.from_trajectories(trajectories)
    n = len(trajectories)
    lo = int(np.flatnonzero(step.lcp == 0)[-1])
    for unit in (Unit(0, n, 0, 0), Unit(lo, n, 0, 0)):
        rows = step.unit_rows(unit)
        batch = pack([trajectories[i] for i in step.order[unit.lo : unit.hi]])
        assert rows.num_rows == batch.num_compact
        every = np.arange(batch.num_compact)
        assert rows.positions(every).tolist() == batch.positions.tolist()
        for r in every.tolist():
            path = {x for a, b in rows.ancestor_ranges(r) for x in range(a, b)}
            assert path == ancestors(batch, r)
        assert rows.mid_path(every[1:]).tolist() == (batch.parent[1:] == every[:-1]).tolist()


def test_path_longer_than_capacity():
    """One trajectory of 3 T + 5 tokens and a fork off it plan in carry mode; duplicate mode refuses them."""
    rng = np.random.default_rng(0)
    long = rng.integers(1, 50, size=3 * 16 + 5)
    fork = np.concatenate([long[:20], [0, 0, 0]])
    trajectories = [Trajectory(long), Trajectory(fork)]
    plan = plan_carry(trajectories, 16, 1)
    check_carry(plan, trajectories, 16, 1)
    assert plan.total_compact_tokens == plan.trie_compact_tokens == 53 + 3
    assert len(plan.microbatches) == 4 and plan.max_context_rows > 16
    with pytest.raises(ValueError, match="cannot be split"):
        plan_microbatches(trajectories, 16, 1)


def test_trees_stay_on_their_replica_and_balance():
    """Four separate trees of a step of equal size over two replicas: two trees each, equal rows, no duplication."""
    rng = np.random.default_rng(1)
    trajectories = []
    for tree in range(4):
        prompt = np.concatenate([[tree + 1], rng.integers(1, 9, size=30)])
        for _ in range(3):
            trajectories.append(Trajectory(np.concatenate([prompt, rng.integers(10, 99, size=40)])))
    plan = plan_carry(trajectories, 64, 2)
    check_carry(plan, trajectories, 64, 2)
    assert plan.total_compact_tokens == plan.trie_compact_tokens
    assert plan.slot_work().sum(axis=0).tolist() == [2 * 151, 2 * 151]
    assert plan.objective()[0] == plan.total_compact_tokens


def test_inputs_checked():
    with pytest.raises(ValueError, match="no trajectories"):
        plan_carry([], 8, 1)
    with pytest.raises(ValueError, match="`capacity` must be >= 1"):
        plan_carry([Trajectory([1, 2])], 0, 1)


def test_extra_view_rows_count_cuts_inside_paths():
    """A cut before a row whose parent is the previous row adds that row's position to the views; after a leaf none."""
    rng = np.random.default_rng(2)
    trajectories = [Trajectory(rng.integers(1, 50, size=40)) for _ in range(3)]
    plan = plan_carry(trajectories, 16, 1)
    expected = [0] * len(plan.trees)
    for mb in plan.microbatches:
        for p in mb.parts:
            batch = pack([trajectories[i] for i in plan.trees[p.tree]])
            if p.start > 0 and batch.parent[p.start] == p.start - 1:
                expected[p.tree] += int(batch.positions[p.start])
    assert list(plan.tree_extra_view_rows) == expected and sum(expected) > 0


def test_context_bound_of_one_long_path():
    """40 tokens at T = 16: J = 3 slots of c = 14 rows, the 12-row head first, so parts [0, 12), [12, 26), [26, 40)
    with contexts 0, 12, 26; every later part reads all earlier ones, so all three are open at the end."""
    plan = plan_carry([Trajectory(np.arange(1, 41))], 16, 1)
    assert [(p.start, p.stop, p.context_rows, p.entries) for mb in plan.microbatches for p in mb.parts] == [
        (0, 12, 0, ()), (12, 26, 12, (12,)), (26, 40, 26, (26,))]
    assert plan.events == ((("forward", 0), ("forward", 1), ("forward", 2), ("backward", 2), ("backward", 1),
                            ("backward", 0)),)
    sizes = ContextSizes(full_attention_row=1, linear_state=100, linear_row=1, conv_row=1, chunk_size=8, conv_width=3)
    bound = plan.context_bound(sizes)
    # linear: one anchor state each (8 and 24) plus 4 and 2 replayed rows; conv: 2 predecessor rows per entry
    assert bound.part_bytes == {"full_attention": 26, "linear_attention": 104, "conv": 2}
    # exports: rows 0-11 (read by both later parts, counted once) and rows 12-25
    assert [mb.exported_rows for mb in plan.microbatches] == [12, 14, 0]
    assert (bound.held_full_attention_bytes, bound.max_open_microbatches, bound.max_open_rows) == (26, 3, 40)
