"""`models.tree.round_chains`: a layer's calls regrouped per plan round, each sequence's pieces as one chain, run the
same chunks from the same states as the calls run one by one (an integer stand-in for the delta rule), on planner
plans with and without replay and on hand-built calls."""

import numpy as np
import pytest

from models.tree.core_calls import core_calls
from models.tree.layout import CoreCalls
from tests.models.ops.kda_calls_cases import ROUNDS, B, layer_calls
from tests.models.tree.test_core_calls import chunk_step, make_plan


def _chunk_starts_by_calls(calls, layout: CoreCalls, chunk: int, outside: int):
    """Run the calls one by one: the state at each row's chunk start [T] and the state table."""
    rows = np.concatenate([c.gather for c in calls])
    table = [0, *(1000 + i for i in range(outside))] + [None] * (layout.table_size - 1 - outside)
    out, bounds = np.full(rows.size, -1), layout.row_bounds
    for j, call in enumerate(calls):
        for n in range(call.num_sequences):
            state = table[call.init_state[n]]
            a, b = bounds[j] + call.cu_seqlens[n], bounds[j] + call.cu_seqlens[n + 1]
            for start in range(a, b, chunk):
                out[start : min(start + chunk, b)] = state
                state = chunk_step(state, rows[start : min(start + chunk, b)])
            table[call.first_state + n] = state
    return out, table


def _chunk_starts_by_chains(calls, layout: CoreCalls, chunk: int, outside: int):
    """Run the chains round by round, each sequence's pieces in one go; also checks that a round reads only entries
    written before it and that each piece's first chunk is fla's chunk offset of that piece among all calls'."""
    rows = np.concatenate([c.gather for c in calls])
    table = [0, *(1000 + i for i in range(outside))] + [None] * (layout.table_size - 1 - outside)
    fla_first = dict(zip(layout.cu_seqlens[:-1].tolist(), layout.chunk_offsets[:-1].tolist()))
    out, written = np.full(rows.size, -1), set(range(1 + outside))
    for chains in layout.chains:
        init, bounds = chains.init.tolist(), chains.pieces.tolist()
        assert written.issuperset(init), "a round reads only entries written before it"
        for n in range(chains.num_sequences):
            state = table[init[n]]
            for p in range(bounds[n], bounds[n + 1]):
                a, b = int(chains.piece_bos[p]), int(chains.piece_eos[p])
                assert fla_first[a] == int(chains.piece_boh[p])
                for start in range(a, b, chunk):
                    out[start : min(start + chunk, b)] = state
                    state = chunk_step(state, rows[start : min(start + chunk, b)])
                table[int(chains.piece_state[p])] = state
        written.update(chains.piece_state.tolist())
        entries = chains.grad_entries
        expected = None if not any(init) else init
        got = None if entries is None else list(range(entries.start, entries.stop)) if isinstance(entries, slice) \
            else entries.tolist()
        assert got == expected
    return out, table


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no replay"])
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("seed", range(10))
def test_chains_run_the_calls_chunks_from_the_same_states(seed, chunk, replay):
    _, plan = make_plan(seed, chunk=chunk, replay=replay)
    calls, _ = core_calls(plan)
    outside = int(plan.external_state_context.size)
    layout = CoreCalls.build(calls, chunk, 1 + outside)
    assert sum(int(c.pieces[-1]) for c in layout.chains) == layout.cu_seqlens.numel() - 1  # every piece once
    by_calls = _chunk_starts_by_calls(calls, layout, chunk, outside)
    by_chains = _chunk_starts_by_chains(calls, layout, chunk, outside)
    assert (by_calls[0] == by_chains[0]).all() and (by_calls[0] >= 0).all() and by_calls[1] == by_chains[1]


def test_round_chains_are_each_sequence_s_pieces_in_call_order():
    """`CoreCalls.chains`: per plan round, each sequence's pieces as one chain (rows and chunks among all calls',
    the entry each piece's final state goes to), starting from its first piece's entry; a round's initial-state
    gradients go to a run of entries as a slice, to shared entries as an index."""
    calls = CoreCalls.build(layer_calls(ROUNDS["dropping"]), B, table_start=4)
    first, side = calls.chains
    assert first.num_sequences == 3 and first.pieces.tolist() == [0, 3, 5, 6]
    # sequence 0: call 0 rows [0, 128), call 1 rows [232, 360), call 2 rows [488, 565); sequence 1, then 2
    assert first.piece_bos.tolist() == [0, 232, 488, 128, 360, 192]
    assert first.piece_eos.tolist() == [128, 360, 565, 192, 488, 232]
    assert first.piece_boh.tolist() == [0, 4, 8, 2, 6, 3]
    assert first.piece_state.tolist() == [4, 7, 9, 5, 8, 6]
    assert first.init.tolist() == [1, 2, 3] and first.grad_entries == slice(1, 4)
    assert side.pieces.tolist() == [0, 1, 2] and side.piece_bos.tolist() == [565, 635]
    assert side.piece_boh.tolist() == [10, 12] and side.piece_state.tolist() == [10, 11]
    assert side.init.tolist() == [4, 4] and side.grad_entries.tolist() == [4, 4]
    zeros = CoreCalls.build(layer_calls(ROUNDS["single call"], outside=False, side=False), B, table_start=1)
    assert zeros.rounds == 1 and zeros.chains[0].grad_entries is None


def test_round_chains_refuse_a_piece_that_does_not_continue_its_sequence():
    calls = layer_calls(ROUNDS["continuing"])
    calls[1].init_state = calls[1].init_state[::-1].copy()  # each second piece starts from another sequence's state
    with pytest.raises(AssertionError, match="continues its sequence"):
        CoreCalls.build(calls, B, table_start=4)
