"""ExecutionPlan (planner/calls/plan.py): layout invariants and an exact simulation of the rounds on packed
trajectories."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.calls.min_calls import mandatory_replay
from planner.calls.plan import build_execution_plan, plan_calls, plan_segment_tree
from planner.calls.schedule import min_call_schedule
from planner.calls.segment_tree import SegmentTree
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.trees import rollout_batches

MOD = 2**31 - 1  # exact arithmetic: the recurrence runs on integers modulo a prime


def segment_depth(seg_parent):
    """[G] parent-child edges above each segment, counted by walking up the parent links."""
    depth = np.zeros(seg_parent.size, dtype=np.int64)
    for g in range(seg_parent.size):
        p = seg_parent[g]
        while p >= 0:
            depth[g] += 1
            p = seg_parent[p]
    return depth


def check_plan(plan, parent, positions, segment, depth):
    """Layout invariants. parent/positions/segment: [C] of the compact rows; depth: [G] segment depth."""
    B, C = plan.chunk_size, positions.size
    p2c, c2p = plan.physical_to_compact, plan.compact_to_physical
    assert sorted(p2c.tolist()) == list(range(C)) and (c2p[p2c] == np.arange(C)).all()
    assert plan.round_row_offsets[0] == 0 and plan.round_row_offsets[-1] == C
    assert (plan.handoff_depth == depth[segment]).all()
    produced = []  # (round, global sequence, chunk) of every requested state, in global order
    for r, rnd in enumerate(plan.rounds):
        # Own rows of the round are exactly its physical block, in gather order: every row is output exactly once.
        assert (rnd.gather[rnd.is_output] == np.arange(plan.round_row_offsets[r], plan.round_row_offsets[r + 1])).all()
        assert rnd.cu_seqlens[0] == 0 and rnd.cu_seqlens[-1] == rnd.gather.size
        assert rnd.num_replay.sum() == plan.round_replay[r] == (~rnd.is_output).sum()
        for i in range(rnd.num_sequences):
            rows = p2c[rnd.gather[rnd.cu_seqlens[i] : rnd.cu_seqlens[i + 1]]]
            rep, anchor = int(rnd.num_replay[i]), int(rnd.anchor[i])
            # A contiguous path of positions starting at the anchor; replay rows first, then own rows.
            assert (positions[rows] == anchor + np.arange(rows.size)).all()
            assert (parent[rows[1:]] == rows[:-1]).all()
            is_output = rnd.is_output[rnd.cu_seqlens[i] : rnd.cu_seqlens[i + 1]]
            assert is_output.tolist() == [False] * rep + [True] * (rows.size - rep)
            segs = rnd.segments[rnd.segment_offsets[i] : rnd.segment_offsets[i + 1]]
            assert (np.unique(segment[rows[rep:]]) == np.sort(segs)).all()
            fork = anchor + rep
            if plan.replay:
                assert anchor == fork // B * B and rep < B  # the state comes from floor(p/B)*B on the path
            else:
                assert rep == 0
            src = int(rnd.init_state[i])
            if src < 0:
                assert anchor == 0 and parent[rows[0]] == -1
                continue
            r_src, seq, chunk = produced[src]  # only states of earlier rounds exist yet
            assert r_src < r and src < plan.state_offsets[r]
            src_rnd = plan.rounds[r_src]
            local = seq - plan.round_seq_offsets[r_src]
            lo, hi = src_rnd.cu_seqlens[local], src_rnd.cu_seqlens[local + 1]
            # The state at the start of `chunk` (or the final state) follows the producer's core rows up to there,
            # which must be the consumer's path up to its anchor.
            last = p2c[src_rnd.gather[lo + min(chunk * B, hi - lo) - 1]]
            assert positions[last] == anchor - 1 and parent[rows[0]] == last
        for seq, chunk in zip(rnd.state_seq, rnd.state_chunk):
            produced.append((r, int(plan.round_seq_offsets[r] + seq), int(chunk)))
            n_chunks = -(-(rnd.cu_seqlens[seq + 1] - rnd.cu_seqlens[seq]) // B)
            assert 0 < chunk <= n_chunks
    assert len(produced) == plan.num_states and len(set(produced)) == len(produced)
    used = np.concatenate([rnd.init_state for rnd in plan.rounds])
    assert set(used[used >= 0].tolist()) == set(range(plan.num_states))  # no state is requested in vain


def coefficients(tokens, positions):
    """a_t, b_t of the recurrence for a token at a position (same on the tree and on the trajectory)."""
    a = (1 + 48271 * (tokens * 1009 + positions + 1)) % MOD
    b = (7 + 69621 * (tokens * 31 + positions * 17 + 5)) % MOD
    return a, b


def simulate(plan, tokens, positions, k):
    """Run the rounds with a chunkwise recurrence h_t = a_t h_{t-1} + b_t, output o_t = h_t + k * (state at the start
    of t's chunk); k != 0 makes outputs depend on where chunks start (a wrong phase shows). Returns [C] physical."""
    B = plan.chunk_size
    a, b = coefficients(tokens[plan.physical_to_compact], positions[plan.physical_to_compact])
    a, b = a.tolist(), b.tolist()
    states, out = [], np.full(positions.size, -1, dtype=np.int64)
    for r, rnd in enumerate(plan.rounds):
        assert len(states) == plan.state_offsets[r]
        core_out = np.zeros(rnd.gather.size, dtype=np.int64)
        boundary = {}
        for i in range(rnd.num_sequences):
            lo, hi = int(rnd.cu_seqlens[i]), int(rnd.cu_seqlens[i + 1])
            h = 0 if rnd.init_state[i] < 0 else states[rnd.init_state[i]]
            n_chunks = -(-(hi - lo) // B)
            for c in range(n_chunks):
                boundary[i, c] = start = h
                for t in range(lo + c * B, min(lo + (c + 1) * B, hi)):
                    row = rnd.gather[t]
                    h = (a[row] * h + b[row]) % MOD
                    core_out[t] = (h + k * start) % MOD
            boundary[i, n_chunks] = h
        states.extend(boundary[int(i), int(c)] for i, c in zip(rnd.state_seq, rnd.state_chunk))
        out[plan.round_row_offsets[r] : plan.round_row_offsets[r + 1]] = core_out[rnd.is_output]
    return out


def trajectory_reference(trajectories, B, k):
    """The same recurrence run on each trajectory alone with its own chunks [0, B), [B, 2B), ..."""
    out = []
    for t in trajectories:
        a, b = coefficients(t.tokens, np.arange(len(t)))
        h = 0
        for pos in range(len(t)):
            if pos % B == 0:
                start = h
            h = (int(a[pos]) * h + int(b[pos])) % MOD
            out.append((h + k * start) % MOD)
    return np.asarray(out, dtype=np.int64)


def check_batch(trajectories, B, replay=True):
    batch = pack(trajectories)
    plan = plan_calls(batch, B, replay=replay)
    depth = segment_depth(batch.seg_parent)
    check_plan(plan, batch.parent, batch.positions, batch.segment, depth)
    tree = SegmentTree.from_batch(batch)
    if replay:
        assert plan.total_replay == mandatory_replay(tree, B)
        assert plan.num_rounds == min_call_schedule(tree, B).num_rounds
    else:
        assert plan.num_rounds == depth.max() + 1 and plan.total_replay == 0
    sem_physical = plan.compact_to_physical[batch.sem_to_compact]
    for k in (0, 3):
        got = simulate(plan, batch.tokens, batch.positions, k)[sem_physical]
        want = trajectory_reference(trajectories, B, k)
        if replay or k == 0:
            assert (got == want).all(), f"k={k}: {np.count_nonzero(got != want)} of {got.size} positions differ"
    return batch, plan


@settings(max_examples=150, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=30), st.sampled_from([1, 2, 3, 4, 8]))
def test_plan_invariants_and_exact_simulation(trajectories, B):
    check_batch(trajectories, B)


@settings(max_examples=60, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=30), st.sampled_from([2, 3, 4]))
def test_no_replay_plan_is_executable(trajectories, B):
    """Without replay the plan still runs (exact when outputs ignore the chunk phase, k = 0)."""
    check_batch(trajectories, B, replay=False)


def test_no_replay_ablation_changes_chunk_phase():
    """The ablation must bite: with a fork inside a chunk, phase-sensitive outputs differ from the trajectory."""
    base = list(range(10, 22))
    trajectories = [Trajectory(base), Trajectory(base[:6] + [90, 91, 92, 93, 94])]
    batch, plan = check_batch(trajectories, 4, replay=False)
    got = simulate(plan, batch.tokens, batch.positions, 3)[plan.compact_to_physical[batch.sem_to_compact]]
    want = trajectory_reference(trajectories, 4, 3)
    assert (got != want).any()
    assert plan.rounds[1].anchor.tolist() == [6, 6] and plan.rounds[1].state_chunk.size == 0
    assert plan.rounds[0].state_chunk.tolist() == [2]  # final state of the root segment [0, 6): 2 chunks of 4


def rows_at(batch, trajectory_index, lo, hi):
    offset = batch.traj_offsets[trajectory_index]
    return batch.sem_to_compact[offset + lo : offset + hi]


@pytest.mark.parametrize(
    "fork, side_round", [(3, 0), (4, 1), (5, 1), (2, 0), (9, 1)], ids=["B-1", "B", "B+1", "<B", "2B+1"]
)
def test_fork_positions(fork, side_round):
    B = 4
    base = list(range(10, 22))
    trajectories = [Trajectory(base), Trajectory(base[:fork] + [90, 91, 92])]
    batch, plan = check_batch(trajectories, B)
    side = plan.rounds[side_round]
    i = side.num_sequences - 1
    anchor = fork // B * B
    assert (side.anchor[i], side.num_replay[i]) == (anchor, fork - anchor)
    gather = side.gather[side.cu_seqlens[i] : side.cu_seqlens[i + 1]]
    assert (plan.physical_to_compact[gather] == rows_at(batch, 1, anchor, len(base[:fork]) + 3)).all()
    if side_round == 0:
        assert side.init_state[i] == -1
    else:
        assert side.init_state[i] == 0 and plan.rounds[0].state_chunk.tolist() == [fork // B]


def test_same_round_side_branch_shares_its_parent_sequence_source():
    """A side branch started in round 2 forks again inside its entry chunk: the new branch joins round 2 from the
    same boundary state (same init_state), replaying from the same anchor."""
    B = 4
    base = list(range(10, 22))
    first = base[:5] + [50, 51, 52, 53]  # forks at 5: from S_4, round 2, replay 1
    second = first[:6] + [70, 71]  # forks at 6 < 8 inside the first branch's entry chunk
    batch, plan = check_batch([Trajectory(base), Trajectory(first), Trajectory(second)], B)
    assert plan.num_rounds == 2
    r2 = plan.rounds[1]
    assert r2.anchor.tolist() == [4, 4] and r2.num_replay.tolist() == [1, 2]
    assert r2.init_state.tolist() == [0, 0] and plan.num_states == 1


def test_prefix_and_identical_trajectories_make_one_sequence():
    base = list(range(10, 30))
    batch, plan = check_batch([Trajectory(base), Trajectory(base[:7]), Trajectory(base)], 4)
    assert plan.num_rounds == 1 and plan.total_replay == 0 and plan.rounds[0].num_sequences == 1


def test_deep_nesting_and_several_trees():
    rng = np.random.default_rng(5)
    trajectories = []
    for tree in range(3):
        path = list(rng.integers(0, 1000, size=int(rng.integers(3, 9))) + 1000 * tree)
        trajectories.append(Trajectory(path + [1] * 10))
        for _ in range(8):  # every new branch forks off the previous one, deeper and deeper
            fork = len(path) + int(rng.integers(1, 6))
            path = trajectories[-1].tokens[:fork].tolist()
            trajectories.append(Trajectory(path + list(rng.integers(0, 1000, size=8) + 5000)))
    batch, plan = check_batch(trajectories, 4)
    assert segment_depth(batch.seg_parent).max() >= 8 and plan.handoff_depth.max() >= 8
    assert len({int(batch.segment[batch.sem_to_compact[batch.traj_offsets[i]]]) for i in range(len(trajectories))}) == 3


def test_segment_tree_plan_uses_segment_order_rows():
    B = 64
    tree = SegmentTree.from_lengths([-1, 0, 0, 1, 1], [B - 1, 2, 10, 5, 7])  # Figure 2(a)
    plan = plan_segment_tree(tree, B)
    positions = np.concatenate([np.arange(s, e) for s, e in zip(tree.start, tree.end)])
    row_parent = np.arange(positions.size) - 1
    offsets = tree.row_offsets()
    row_parent[offsets[:-1]] = np.where(tree.parent >= 0, offsets[tree.parent + 1] - 1, -1)
    segment = np.repeat(np.arange(5), tree.lengths)
    check_plan(plan, row_parent, positions, segment, tree.depth)
    r1, r2 = plan.rounds
    assert r1.segments.tolist() == [0, 1, 3, 2] and r2.segments.tolist() == [4]
    assert r1.gather.tolist() == list(range(70)) + list(range(63)) + list(range(70, 80))
    assert (r1.state_seq.tolist(), r1.state_chunk.tolist()) == ([0], [1])
    assert r2.gather.tolist() == [64] + list(range(80, 87)) and r2.init_state.tolist() == [0]


def test_input_errors():
    tree = SegmentTree.from_lengths([-1, 0, 0], [5, 1, 1])
    with pytest.raises(TypeError, match="CompactBatch"):
        plan_calls(tree)
    with pytest.raises(ValueError, match="chunk_size"):
        plan_calls(pack([Trajectory([1, 2])]), chunk_size=-4)
    with pytest.raises(ValueError, match="seg_offsets"):
        build_execution_plan(min_call_schedule(tree, 4), np.array([0, 5, 6, 8]))
