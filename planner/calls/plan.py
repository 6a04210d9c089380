"""ExecutionPlan: how the linear-attention layers of one microbatch run on its compact rows (HARTS §3.3-3.4).

Legend: C compact rows, G segments, N sequences (all rounds), N_r sequences of round r, T_r core-input rows of round r
(its own rows plus its replay rows), R_r boundary states requested in round r.

Physical layout. Every layer works on the C rows in one physical order: rounds in order, within a round sequences in
order, within a sequence its own rows in position order. So the own rows of round r are the physical block
[round_row_offsets[r], round_row_offsets[r+1]), and those of sequence n the block [seq_row_offsets[n],
seq_row_offsets[n+1]).

Round r is one packed call of the linear-attention core on the rows `gather` (physical indices), split by
`cu_seqlens`; sequence i first replays `num_replay[i]` ancestor rows (positions [anchor[i], first own position), rows
of other sequences: state updates only, `is_output` False) and then runs its own rows, so the output rows with
`is_output` are exactly the round's physical block, in order. Each sequence is chunked from its start:
chunk c covers gather rows [c*B, (c+1)*B) of the sequence, i.e. positions [anchor + c*B, anchor + (c+1)*B), which are
the trajectory-wise chunks because the anchor is chunk-aligned. The call returns the states requested by
(state_seq, state_chunk): the state at the start of chunk state_chunk of sequence state_seq (state_chunk = number
of chunks: the final state). Requested states of all rounds, concatenated round by round, are numbered globally
(round r's at [state_offsets[r], state_offsets[r+1])); init_state[i] is the global number of the state sequence i
starts from (always from an earlier round), or -1 for the zero state. Several sequences may share one state.

The no-replay ablation (replay=False) has the same structure: every segment is a sequence starting at its fork
position (not chunk-aligned) from its parent segment's final state, num_replay = 0, one round per tree level.

Prefix carry. With external roots (`planner.calls.segment_tree.SegmentTree.external`) a sequence may replay
rows of an outside path and start from that path's state: `gather` entries C + i name the outside row
(external_context[i], external_position[i]) (path id, position), and `RoundPlan.external_state` names the outside
state (external_state_context[j], external_state_position[j]) a sequence starts from. `exported_rows` asks the
plan for the states after some of its own rows (what a later part starts from): they become requested states,
numbered `exported_states`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.calls.schedule import CallSchedule, min_call_schedule, no_replay_schedule
from planner.calls.segment_tree import SegmentTree
from planner.index_arrays import inverse_permutation, offsets
from planner.pack import CompactBatch

__all__ = ["ExecutionPlan", "RoundPlan", "plan_calls", "plan_segment_tree", "build_execution_plan"]


@dataclass(eq=False)
class RoundPlan:
    """One packed linear-attention call. All arrays int64 except is_output (bool).

    gather [T_r]: physical rows fed to the core; per sequence its replay rows, then its own rows.
    is_output [T_r]: False on replay rows.
    cu_seqlens [N_r+1]: sequence boundaries in `gather`.
    anchor [N_r]: position of each sequence's first core row (chunk-aligned with replay).
    num_replay [N_r]: replay rows at the head of each sequence.
    init_state [N_r]: global number of the initial state (see ExecutionPlan.state_offsets), -1 for zeros.
    state_seq [R_r], state_chunk [R_r]: requested states, sorted by (sequence, chunk), unique.
    segment_offsets [N_r+1], segments [G_r]: segment ids of each sequence in position order.
    external_state [N_r]: index of the outside state the sequence starts from (ExecutionPlan.external_state_*), else
        -1 (then init_state says where its state comes from).
    """

    gather: np.ndarray
    is_output: np.ndarray
    cu_seqlens: np.ndarray
    anchor: np.ndarray
    num_replay: np.ndarray
    init_state: np.ndarray
    state_seq: np.ndarray
    state_chunk: np.ndarray
    segment_offsets: np.ndarray
    segments: np.ndarray
    external_state: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.anchor.size)


@dataclass(eq=False)
class ExecutionPlan:
    """The plan the model runtime consumes without re-planning (see the module docstring for the semantics).

    chunk_size: B. replay: False for the no-replay ablation.
    num_rounds, total_replay (R, HARTS eq. 15 with replay, 0 without), round_replay [num_rounds].
    physical_to_compact [C], compact_to_physical [C]: the physical order shared by all layers.
    round_row_offsets [num_rounds+1]: own rows of round r in physical order.
    round_seq_offsets [num_rounds+1]: sequences of round r among the N sequences (global sequence = offset + local).
    seq_row_offsets [N+1]: own rows of each sequence in physical order.
    state_offsets [num_rounds+1]: global numbers of the states requested in round r.
    rounds: list of RoundPlan, one per round.
    handoff_depth [C] (compact order): state handoffs above the row's segment (its segment-tree depth; root 0).
    schedule: the segment-level CallSchedule the plan was built from.
    external_context [X], external_position [X]: the outside rows the replay reads (gather entry C + i is row i),
        sorted by (path, position); empty without external roots.
    external_state_context [Y], external_state_position [Y]: the outside path states sequences start from, sorted.
    exported_states [Z]: global numbers of the states after the `exported_rows` of `build_execution_plan`.
    Semantic positions map to physical rows by compact_to_physical[batch.sem_to_compact].
    """

    chunk_size: int
    replay: bool
    num_rounds: int
    total_replay: int
    round_replay: np.ndarray
    physical_to_compact: np.ndarray
    compact_to_physical: np.ndarray
    round_row_offsets: np.ndarray
    round_seq_offsets: np.ndarray
    seq_row_offsets: np.ndarray
    state_offsets: np.ndarray
    rounds: list[RoundPlan]
    handoff_depth: np.ndarray
    schedule: CallSchedule
    external_context: np.ndarray
    external_position: np.ndarray
    external_state_context: np.ndarray
    external_state_position: np.ndarray
    exported_states: np.ndarray

    @property
    def num_states(self) -> int:
        return int(self.state_offsets[-1])

    def view_rows(self, positions: np.ndarray) -> int:
        """Rows of the full-attention branch views of the plan's sequences (`models.tree.layout`): a sequence's
        keys are its path from the root through its last row, so it reads that row's position + 1 rows.
        `positions` [C]: the original position of each compact row (`CompactBatch.positions`)."""
        ends = self.seq_row_offsets[1:][np.diff(self.seq_row_offsets) > 0]
        return int((positions[self.physical_to_compact[ends - 1]] + 1).sum())


def _outside_rows(tree, anchor_of_root: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(path [X], position [X]) of the outside rows the external roots replay, [anchor, start) of each, sorted and
    unique."""
    roots = np.flatnonzero(tree.external >= 0)
    lo, hi = anchor_of_root[roots], tree.start[roots]
    path = np.repeat(tree.external[roots], hi - lo)
    position = np.arange(path.size) - np.repeat(offsets(hi - lo)[:-1] - lo, hi - lo)
    keys = np.unique(np.stack([path, position], axis=1), axis=0).reshape(-1, 2)
    return keys[:, 0].copy(), keys[:, 1].copy()


def _key_index(path: np.ndarray, position: np.ndarray, want_path: np.ndarray, want_position: np.ndarray) -> np.ndarray:
    """Index of each wanted (path, position) in the sorted unique pairs (path, position)."""
    stride = int(max(position.max(initial=0), want_position.max(initial=0))) + 1
    return np.searchsorted(path * stride + position, want_path * stride + want_position)


def build_execution_plan(schedule: CallSchedule, seg_offsets: np.ndarray | None = None,
                         exported_rows: np.ndarray | None = None) -> ExecutionPlan:
    """Lay out a schedule over compact rows.

    seg_offsets: [G+1] int, compact rows of segment g are [seg_offsets[g], seg_offsets[g+1]) in position order
    (CompactBatch.seg_offsets). Default: segments in id order, as for a bare segment tree.
    exported_rows: [Z] compact rows whose following state another part starts from (prefix carry); each must end
    a chunk of its sequence (position + 1 chunk-aligned). Their states are requested (`exported_states`).
    """
    tree, B = schedule.tree, schedule.chunk_size
    G = tree.num_segments
    seg_len = tree.lengths
    seg_offsets = tree.row_offsets() if seg_offsets is None else np.asarray(seg_offsets, dtype=np.int64)
    if seg_offsets.shape != (G + 1,) or seg_offsets[0] != 0 or not np.array_equal(np.diff(seg_offsets), seg_len):
        raise ValueError(
            f"`seg_offsets` must be [G+1] = [{G + 1}] row offsets starting at 0 with one row per segment position, "
            f"got shape {seg_offsets.shape}"
        )
    C = int(seg_offsets[-1])
    N = schedule.num_sequences
    num_rounds = schedule.num_rounds

    # Physical order: segments in schedule order, each segment's rows in position order.
    segs = schedule.seq_segments
    lens = seg_len[segs]
    physical_to_compact = np.repeat(seg_offsets[segs] - offsets(lens)[:-1], lens) + np.arange(C)
    compact_to_physical = inverse_permutation(physical_to_compact)
    own = np.add.reduceat(lens, schedule.seq_segment_offsets[:-1])  # [N]
    seq_row_offsets = offsets(own)

    # Replay rows: the `rep` path ancestors of each sequence's first own row, in position order. Rows C + i are the
    # outside rows of external roots (each one's parent is the one before it on its path).
    ext_path, ext_position = _outside_rows(tree, schedule.seq_anchor[schedule.seg_sequence])
    X = ext_path.size
    row_parent = np.arange(C + X, dtype=np.int64) - 1
    if X:
        follows = np.r_[False, (ext_path[1:] == ext_path[:-1]) & (ext_position[1:] == ext_position[:-1] + 1)]
        row_parent[C:] = np.where(follows, row_parent[C:], -1)
    first_rows = seg_offsets[:-1]
    row_parent[first_rows] = np.where(tree.parent >= 0, seg_offsets[tree.parent + 1] - 1, -1)
    ext_roots = np.flatnonzero((tree.external >= 0) & (tree.start > schedule.seq_anchor[schedule.seg_sequence]))
    row_parent[first_rows[ext_roots]] = C + _key_index(ext_path, ext_position, tree.external[ext_roots],
                                                       tree.start[ext_roots] - 1)
    rep = schedule.seq_replay
    rep_offsets = offsets(rep)
    replay_rows = np.empty(int(rep_offsets[-1]), dtype=np.int64)
    cur = row_parent[seg_offsets[segs[schedule.seq_segment_offsets[:-1]]]]
    for k in range(1, int(rep.max(initial=0)) + 1):
        active = rep >= k
        replay_rows[rep_offsets[:-1][active] + rep[active] - k] = cur[active]
        cur = np.where(active, row_parent[np.maximum(cur, 0)], cur)

    # Core input: per sequence [replay rows, own rows], all sequences of all rounds back to back.
    block_offsets = offsets(rep + own)
    gather = np.empty(C + replay_rows.size, dtype=np.int64)
    is_output = np.ones(gather.size, dtype=bool)
    gather[np.arange(C) + np.repeat(block_offsets[:-1] + rep - seq_row_offsets[:-1], own)] = np.arange(C)
    replay_at = np.arange(replay_rows.size) + np.repeat(block_offsets[:-1] - rep_offsets[:-1], rep)
    gather[replay_at] = np.r_[compact_to_physical, C + np.arange(X)][replay_rows]
    is_output[replay_at] = False

    # Requested states: (producer sequence, chunk), unique, numbered in (producer, chunk) order = round order.
    seq_round = schedule.seq_round
    consumers = np.flatnonzero(schedule.seq_source >= 0)
    producers = schedule.seq_source[consumers]
    offset_in_seq = schedule.seq_source_position[consumers] - schedule.seq_anchor[producers]
    core_len = rep + own
    at_boundary = offset_in_seq % B == 0
    at_end = offset_in_seq == core_len[producers]
    assert (at_boundary | at_end).all() and (offset_in_seq > 0).all(), "a requested state is not a chunk boundary"
    assert (seq_round[producers] < seq_round[consumers]).all(), "a state is consumed before its round returns"
    chunk = -(-offset_in_seq // B)
    export_seq, export_chunk = _export_requests(schedule, seg_offsets, exported_rows)
    stride = int(max(chunk.max(initial=0), export_chunk.max(initial=0))) + 1
    keys, state_of_request = np.unique(
        np.r_[producers * stride + chunk, export_seq * stride + export_chunk], return_inverse=True
    )
    state_of_consumer, exported_states = np.split(state_of_request.reshape(-1), [consumers.size])
    state_producer, state_chunk = keys // stride, keys % stride
    state_offsets = np.searchsorted(seq_round[state_producer], np.arange(num_rounds + 1)).astype(np.int64)
    init_state = np.full(N, -1, dtype=np.int64)
    init_state[consumers] = state_of_consumer

    # Outside states: sequences without a source under an external path, anchored after its start.
    outside = (schedule.seq_source < 0) & (schedule.seq_context >= 0) & (schedule.seq_anchor > 0)
    state_keys = np.unique(np.stack([schedule.seq_context[outside], schedule.seq_anchor[outside]], axis=1),
                           axis=0).reshape(-1, 2)
    state_path, state_position = state_keys[:, 0].copy(), state_keys[:, 1].copy()
    external_state = np.full(N, -1, dtype=np.int64)
    external_state[outside] = _key_index(state_path, state_position, schedule.seq_context[outside],
                                         schedule.seq_anchor[outside])

    round_seq_offsets = np.searchsorted(seq_round, np.arange(num_rounds + 1)).astype(np.int64)
    rounds = []
    for r in range(num_rounds):
        s0, s1 = int(round_seq_offsets[r]), int(round_seq_offsets[r + 1])
        t0, t1 = int(block_offsets[s0]), int(block_offsets[s1])
        k0, k1 = int(state_offsets[r]), int(state_offsets[r + 1])
        g0, g1 = schedule.seq_segment_offsets[s0], schedule.seq_segment_offsets[s1]
        rounds.append(
            RoundPlan(
                gather=gather[t0:t1],
                is_output=is_output[t0:t1],
                cu_seqlens=block_offsets[s0 : s1 + 1] - t0,
                anchor=schedule.seq_anchor[s0:s1],
                num_replay=rep[s0:s1],
                init_state=init_state[s0:s1],
                state_seq=state_producer[k0:k1] - s0,
                state_chunk=state_chunk[k0:k1],
                segment_offsets=schedule.seq_segment_offsets[s0 : s1 + 1] - g0,
                segments=segs[g0:g1],
                external_state=external_state[s0:s1],
            )
        )
    return ExecutionPlan(
        chunk_size=B,
        replay=schedule.replay,
        num_rounds=num_rounds,
        total_replay=schedule.total_replay,
        round_replay=schedule.round_replay,
        physical_to_compact=physical_to_compact,
        compact_to_physical=compact_to_physical,
        round_row_offsets=seq_row_offsets[round_seq_offsets],
        round_seq_offsets=round_seq_offsets,
        seq_row_offsets=seq_row_offsets,
        state_offsets=state_offsets,
        rounds=rounds,
        handoff_depth=np.repeat(tree.depth, seg_len),
        schedule=schedule,
        external_context=ext_path,
        external_position=ext_position,
        external_state_context=state_path,
        external_state_position=state_position,
        exported_states=exported_states.astype(np.int64),
    )


def _export_requests(schedule: CallSchedule, seg_offsets: np.ndarray,
                     exported_rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(sequence [Z], chunk [Z]) of the states after `exported_rows`: the chunk of its sequence each row ends."""
    rows = np.zeros(0, dtype=np.int64) if exported_rows is None else np.asarray(exported_rows, dtype=np.int64)
    tree = schedule.tree
    if rows.size and (rows.min() < 0 or rows.max() >= seg_offsets[-1]):
        raise ValueError(f"`exported_rows` must be compact rows in [0, {seg_offsets[-1]}), got {rows.tolist()}")
    seg = np.searchsorted(seg_offsets, rows, side="right") - 1
    seq = schedule.seg_sequence[seg]
    offset = tree.start[seg] + rows - seg_offsets[seg] + 1 - schedule.seq_anchor[seq]
    bad = np.flatnonzero(offset % schedule.chunk_size != 0)
    if bad.size:
        r = int(rows[bad[0]])
        raise ValueError(
            f"exported row {r}: the state after it is not at a chunk boundary of its sequence (position + 1 must be "
            f"a multiple of the chunk size {schedule.chunk_size})"
        )
    return seq, offset // schedule.chunk_size


def plan_segment_tree(tree: SegmentTree, chunk_size: int = 64, *, replay: bool = True) -> ExecutionPlan:
    """Plan a bare segment tree; its compact rows are laid out segment by segment in id order."""
    schedule = min_call_schedule(tree, chunk_size) if replay else no_replay_schedule(tree, chunk_size)
    return build_execution_plan(schedule)


def plan_calls(batch: CompactBatch, chunk_size: int = 64, *, replay: bool = True) -> ExecutionPlan:
    """The minimum-call plan of a packed batch (HARTS Algorithm 1), or the no-replay ablation with replay=False."""
    if not isinstance(batch, CompactBatch):
        raise TypeError(f"`batch` must be a planner.pack.CompactBatch, got {type(batch).__name__}")
    tree = SegmentTree.from_batch(batch)
    schedule = min_call_schedule(tree, chunk_size) if replay else no_replay_schedule(tree, chunk_size)
    return build_execution_plan(schedule, batch.seg_offsets)
