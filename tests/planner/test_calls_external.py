"""External roots and exported states of `planner.calls.plan` (prefix carry): a part of a larger tree starts
its sequences at a(p) from the outside path's state and replays the path's rows [a(p), p); a producer part asks its
plan for the states after chosen rows. Plans without external roots are unchanged (the other plan tests)."""

import numpy as np
import pytest

from planner.calls.min_calls import mandatory_replay
from planner.calls.plan import build_execution_plan
from planner.calls.schedule import min_call_schedule
from planner.calls.segment_tree import SegmentTree

B = 4


def external_tree(start: int) -> SegmentTree:
    """Segment 0 hangs below row start-1 of outside path 0 and ends at start+2, where children 1 and 2 fork."""
    return SegmentTree([-1, 0, 0], [start, start + 2, start + 2], [start + 2, start + 6, start + 3],
                       external=[0, -1, -1])


@pytest.mark.parametrize("start, anchor", [(5, 4), (4, 4), (3, 0), (7, 4)])
def test_external_root_starts_at_its_anchor_and_replays_the_outside_rows(start, anchor):
    tree = external_tree(start)
    schedule = min_call_schedule(tree, B)
    plan = build_execution_plan(schedule)
    C = int(tree.lengths.sum())
    root_seq = schedule.seg_sequence[0]
    assert schedule.seq_anchor[root_seq] == anchor and schedule.seq_context[root_seq] == 0
    assert schedule.total_replay == mandatory_replay(tree, B)
    # The outside rows replayed: positions [anchor, start) of path 0, read as gather entries C + i.
    assert plan.external_context.tolist() == [0] * (start - anchor)
    assert plan.external_position.tolist() == list(range(anchor, start))
    rd = plan.rounds[0]
    first = rd.gather[rd.cu_seqlens[0] : rd.cu_seqlens[0] + start - anchor]
    assert first.tolist() == list(range(C, C + start - anchor)) and not rd.is_output[: start - anchor].any()
    # The outside state at the anchor (zeros at anchor 0).
    expected = [(0, anchor)] if anchor > 0 else []
    assert list(zip(plan.external_state_context.tolist(), plan.external_state_position.tolist())) == expected
    starts_outside = [int(rd.external_state[n]) for rd in plan.rounds for n in range(rd.num_sequences)
                      if rd.external_state[n] >= 0]
    assert all(s == 0 for s in starts_outside) and (len(starts_outside) > 0) == (anchor > 0)


def test_side_branch_of_an_external_root_replays_outside_and_own_rows():
    """Start 5: the side child forks at 7 inside the root's entry chunk [4, 8), so it shares the root's outside
    state (eq. 11) and replays outside row 4 and own rows 5, 6."""
    tree = external_tree(5)
    plan = build_execution_plan(min_call_schedule(tree, B))
    C = int(tree.lengths.sum())
    side = [(rd, n) for rd in plan.rounds for n in range(rd.num_sequences) if rd.num_replay[n] == 3]
    assert len(side) == 1
    rd, n = side[0]
    assert rd.gather[rd.cu_seqlens[n] : rd.cu_seqlens[n] + 3].tolist() == [C, 0, 1]
    assert rd.external_state[n] == 0 and rd.init_state[n] == -1


def test_exported_rows_become_requested_states():
    tree = SegmentTree([-1], [0], [11])
    schedule = min_call_schedule(tree, B)
    plan = build_execution_plan(schedule, exported_rows=np.array([7, 3]))
    rd = plan.rounds[0]
    requested = list(zip(rd.state_seq.tolist(), rd.state_chunk.tolist()))
    assert [requested[s] for s in plan.exported_states] == [(0, 2), (0, 1)]
    assert build_execution_plan(schedule).num_states == 0
    with pytest.raises(ValueError, match="exported row 5: the state after it is not at a chunk boundary"):
        build_execution_plan(schedule, exported_rows=np.array([5]))
    with pytest.raises(ValueError, match="must be compact rows in \\[0, 11\\)"):
        build_execution_plan(schedule, exported_rows=np.array([11]))


@pytest.mark.parametrize("parent, start, external, message", [
    ([-1, 0], [0, 5], [-1, 0], "only a root that starts after position 0"),
    ([-1, 0], [0, 5], [0, -1], "only a root that starts after position 0"),
    ([-1, 0], [0, 5], [-1], "`external` must have one entry per segment"),
])
def test_invalid_external_roots(parent, start, external, message):
    with pytest.raises(ValueError, match=message):
        SegmentTree(parent, start, [5, 6], external=external)
