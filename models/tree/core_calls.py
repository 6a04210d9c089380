"""The plan's linear-attention rounds as kernel calls that need only initial and final states (host side, numpy).

Legend: C compact rows (physical order), T_k core-input rows of call k, N_k sequences of call k, M states in the table.

A round of `planner.calls.plan` is one packed call that also returns intermediate chunk-boundary states (the starts of
side branches). Chunk kernels such as fla's return only each sequence's final state. The requested states are
chunk-aligned, so cutting a sequence at its requested chunk starts leaves its chunk list unchanged: piece j covers
whole chunks, starts from the final state of piece j-1, and its own final state is the state at the next cut.
Call j of a round packs piece j of every sequence that has one. Exact, fp32 states, gradients through the kernel's
own initial/final-state support; cost: 1 + (most cuts in one sequence) calls for the round instead of one. On fla's
KDA kernels only the state recurrences pay that (`models.ops.kda.tree_calls` runs the chunk-local kernels once per
layer); the reference and GDN run the calls one by one (`models.linear_attention.LinearAttention.core_calls`).

States live in one table, in the order they are produced: entry 0 is the zero state, then the plan's outside states
(prefix carry: `ExecutionPlan.external_state_*`, entries 1..Y), then the final states of call 0 (one per sequence),
of call 1, ... A call names its sequences' initial states by table index. Everything here is computed once per
microbatch, so running a layer needs no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.calls.plan import ExecutionPlan, RoundPlan
from planner.index_arrays import offsets

__all__ = ["CoreCall", "core_calls", "core_calls_and_exports"]


@dataclass(eq=False)
class CoreCall:
    """One packed kernel call (all int64 arrays).

    gather [T_k]: physical rows fed to the kernel (replay rows, then own rows, per sequence piece).
    cu_seqlens [N_k+1]: piece boundaries in `gather`.
    init_state [N_k]: table index of each piece's initial state (0 = zeros).
    output_pos [O_k]: positions in `gather` whose outputs are kept (non-replay rows).
    round: the plan round the call belongs to; sequence [N_k]: the round's sequence of each piece. Call j of a round
    packs piece j of its sequences, so a call's sequences are a subset of the previous call's, each starting from
    the final state of its piece there.
    first_state: the table index of the call's first final state (the others follow in piece order).
    """

    gather: np.ndarray
    cu_seqlens: np.ndarray
    init_state: np.ndarray
    output_pos: np.ndarray
    round: int
    sequence: np.ndarray
    first_state: int

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.size - 1)


def _round_calls(rd: RoundPlan, r: int, chunk: int, table_of_global: dict[int, int], state_base: int, table_size: int):
    """Split round r; returns its calls and the new table size, and fills `table_of_global` for the round's
    requested states (global numbers state_base + r)."""
    cu = rd.cu_seqlens
    n_seq = cu.size - 1
    lengths = np.diff(cu)
    num_chunks = -(-lengths // chunk)
    cuts = [[] for _ in range(n_seq)]
    for s, c in zip(rd.state_seq.tolist(), rd.state_chunk.tolist()):
        if 0 < c < num_chunks[s]:
            cuts[s].append(c)
    edges = [[0, *(c * chunk for c in sorted(set(cs))), int(lengths[s])] for s, cs in enumerate(cuts)]
    # State of sequence s at its chunk c, as a table index (filled as the pieces are assigned to calls).
    state_at = [
        {0: 1 + int(rd.external_state[s]) if rd.external_state[s] >= 0
            else table_of_global[int(rd.init_state[s])] if rd.init_state[s] >= 0 else 0}
        for s in range(n_seq)
    ]
    calls = []
    for j in range(max(len(e) - 1 for e in edges)):
        seqs = [s for s in range(n_seq) if len(edges[s]) - 1 > j]
        pieces = [np.arange(cu[s] + edges[s][j], cu[s] + edges[s][j + 1]) for s in seqs]
        positions = np.concatenate(pieces)
        out = rd.is_output[positions]
        calls.append(
            CoreCall(
                gather=rd.gather[positions],
                cu_seqlens=offsets([p.size for p in pieces]),
                init_state=np.array([state_at[s][edges[s][j] // chunk] for s in seqs], dtype=np.int64),
                output_pos=np.flatnonzero(out).astype(np.int64),
                round=r,
                sequence=np.asarray(seqs, dtype=np.int64),
                first_state=table_size,
            )
        )
        for n, s in enumerate(seqs):
            end = edges[s][j + 1]
            state_at[s][-(-end // chunk)] = table_size + n
        table_size += len(seqs)
    for r, (s, c) in enumerate(zip(rd.state_seq.tolist(), rd.state_chunk.tolist())):
        table_of_global[state_base + r] = state_at[s][c]
    return calls, table_size


def core_calls(plan: ExecutionPlan) -> tuple[list[CoreCall], np.ndarray]:
    """All kernel calls of the plan, in order, and `keep` [C]: the position of each physical row's kept output in the
    calls' concatenated rows (replay positions appear in no entry)."""
    calls, keep, _ = core_calls_and_exports(plan)
    return calls, keep


def core_calls_and_exports(plan: ExecutionPlan) -> tuple[list[CoreCall], np.ndarray, np.ndarray]:
    """`core_calls` and the table index of each of the plan's `exported_states` ([Z] int64)."""
    table_of_global: dict[int, int] = {}
    table_size = 1 + plan.external_state_context.size
    calls: list[CoreCall] = []
    for r, rd in enumerate(plan.rounds):
        round_calls, table_size = _round_calls(
            rd, r, plan.chunk_size, table_of_global, int(plan.state_offsets[r]), table_size
        )
        calls.extend(round_calls)
    C = plan.physical_to_compact.size
    keep = np.full(C, -1, dtype=np.int64)
    start = 0
    for c in calls:
        keep[c.gather[c.output_pos]] = start + c.output_pos
        start += c.gather.size
    assert sum(c.output_pos.size for c in calls) == C and (keep >= 0).all(), "calls must output every physical row once"
    exported = np.array([table_of_global[int(g)] for g in plan.exported_states], dtype=np.int64)
    return calls, keep, exported
