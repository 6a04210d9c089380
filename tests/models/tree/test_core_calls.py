"""The plan's rounds as kernel calls that return only final states (`models.tree.core_calls`).

Checked against the plan it comes from: every physical row is output once, a round without mid-sequence requests
stays one call with the round's own rows, a round is split into 1 + (most cuts in one sequence) calls, and every
requested state is the final state of a piece ending at its chunk (so the states a later round starts from are the
ones the plan asked for: an integer stand-in for the recurrence gives the same outputs through the calls as through
the plan's rounds).
"""

import numpy as np
import pytest

from bench.branching import nested_fork_trajectories
from models.tree.core_calls import core_calls
from planner.calls.plan import plan_calls
from planner.pack import pack


def make_plan(seed, chunk=8, replay=True):
    trajs = nested_fork_trajectories(np.random.default_rng(seed), chunk, vocab=50, depth=4)
    batch = pack(trajs)
    return batch, plan_calls(batch, chunk, replay=replay)


def chunk_step(state, rows):
    """A stand-in for the delta rule: the state after a chunk depends on the state before it and every row in it."""
    return (state * 31 + int(rows.sum()) + rows.size) % 1_000_003


def outputs_through_calls(plan, calls, keep):
    """Each physical row's output = the state at the start of its chunk, running the calls with their state table."""
    table, kept = [0], []
    for call in calls:
        out = np.zeros(call.gather.size, dtype=np.int64)
        for n in range(call.num_sequences):
            state = table[call.init_state[n]]
            a, b = call.cu_seqlens[n], call.cu_seqlens[n + 1]
            for start in range(a, b, plan.chunk_size):
                end = min(start + plan.chunk_size, b)
                out[start:end] = state
                state = chunk_step(state, call.gather[start:end])
            table.append(state)
        kept.append(out)
    return np.concatenate(kept)[keep]


def outputs_through_rounds(plan):
    """The same, straight from the plan: one call per round that also returns the requested chunk-boundary states."""
    produced = []
    result = np.zeros(plan.physical_to_compact.size, dtype=np.int64)
    for rd in plan.rounds:
        at = []
        for n in range(rd.cu_seqlens.size - 1):
            state = 0 if rd.init_state[n] < 0 else produced[rd.init_state[n]]
            a, b = rd.cu_seqlens[n], rd.cu_seqlens[n + 1]
            states = [state]
            for start in range(a, b, plan.chunk_size):
                end = min(start + plan.chunk_size, b)
                rows = rd.gather[start:end]
                result[rows[rd.is_output[start:end]]] = state
                state = chunk_step(state, rows)
                states.append(state)
            at.append(states)
        produced.extend(at[s][c] for s, c in zip(rd.state_seq, rd.state_chunk))
    return result


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calls_cover_rows_and_split_only_where_asked(seed, replay):
    batch, plan = make_plan(seed, replay=replay)
    calls, keep = core_calls(plan)
    kept = np.concatenate([c.gather[c.output_pos] for c in calls])
    assert np.array_equal(np.sort(kept), np.arange(batch.num_compact))
    assert np.array_equal(np.concatenate([c.gather for c in calls])[keep], np.arange(batch.num_compact))
    replay = np.ones(sum(c.gather.size for c in calls), dtype=bool)
    replay[keep] = False
    assert replay.sum() == sum(c.gather.size - c.output_pos.size for c in calls)
    expected_calls = 0
    for rd in plan.rounds:
        lengths = np.diff(rd.cu_seqlens)
        chunks = -(-lengths // plan.chunk_size)
        cuts = {}
        for s, c in zip(rd.state_seq, rd.state_chunk):
            if 0 < c < chunks[s]:
                cuts.setdefault(int(s), set()).add(int(c))
        expected_calls += 1 + max((len(v) for v in cuts.values()), default=0)
    assert len(calls) == expected_calls
    assert sum(c.gather.size for c in calls) == sum(rd.gather.size for rd in plan.rounds)  # no extra rows


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("seed", [0, 3])
def test_calls_hand_over_the_requested_states(seed, replay):
    batch, plan = make_plan(seed, replay=replay)
    chunks = [-(-np.diff(rd.cu_seqlens)[rd.state_seq] // plan.chunk_size) for rd in plan.rounds]
    mid_sequence = any(((rd.state_chunk > 0) & (rd.state_chunk < n)).any() for rd, n in zip(plan.rounds, chunks))
    assert mid_sequence or not replay, "the plan has no mid-sequence request: the test lacks bite"
    calls, keep = core_calls(plan)
    assert np.array_equal(outputs_through_calls(plan, calls, keep), outputs_through_rounds(plan))
