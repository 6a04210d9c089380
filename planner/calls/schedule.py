"""Sequences and rounds of a segment tree: which segments share a packed input sequence, and when each one runs.

Legend: G segments, N sequences. Rounds are 0-based here (the CLI prints them 1-based).

A sequence is a chain of direct continuations v_1 -> v_2 -> ... -> leaf. It starts at position `anchor` and first
replays the ancestor rows [anchor, start[v_1]) (state updates only), then computes its own rows. Its initial state is
the zero state (a root, or any sequence with anchor 0) or the state at position `anchor` on its path, produced by an
earlier sequence `source_seq`:

- with replay (HARTS): a side child u of v, with v in sequence P, starts at b = floor(e_v/B)*B. If b is P's own anchor,
  u reuses P's initial state (same source, same round: eq. 11); otherwise P produces the state at b inside its call
  (chunk (b - anchor_P)/B of P) and u runs one round after P. Every sequence takes its earliest legal round.
- without replay (the fidelity ablation, HARTS §5.4 "No-replay"): every segment is its own sequence, starting at its
  fork position from its parent segment's final state, one round per tree level.

An external root (`SegmentTree.external`, prefix carry) forking from an outside path at p starts its sequence at
a(p) (p without replay) from that path's state there, replaying the path's rows [a(p), p): such a sequence has no
source sequence, and its state comes from outside unless its anchor is 0 (`seq_context`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.calls.min_calls import check_chunk_size, direct_children, mandatory_replay, min_calls
from planner.calls.segment_tree import SegmentTree
from planner.index_arrays import inverse_permutation, offsets

__all__ = ["CallSchedule", "schedule_sequences", "min_call_schedule", "no_replay_schedule"]


@dataclass(eq=False)
class CallSchedule:
    """Sequences of a segment tree in execution order: by round, then by first segment id.

    tree, chunk_size, replay (False for the no-replay ablation).
    direct_child [G]: the child continuing each segment's sequence, -1 where none (a leaf; every segment without
        replay).
    seg_sequence [G]: sequence holding each segment.
    seq_segment_offsets [N+1], seq_segments [G]: segments of sequence n in chain (position) order.
    seq_round [N]: 0-based round. seq_anchor [N]: start position of the sequence (chunk-aligned with replay).
    seq_replay [N]: replayed ancestor positions, start[first segment] - anchor.
    seq_source [N]: sequence that produces the initial state, -1 for the zero state.
    seq_source_position [N]: position of that state on the path (= seq_anchor), -1 for the zero state.
    seq_context [N]: the external path (`SegmentTree.external`) above the sequence's segments, -1 for none; a
        sequence with seq_source -1 starts from that path's state at seq_anchor (zeros at anchor 0 or without one).
    """

    tree: SegmentTree
    chunk_size: int
    replay: bool
    direct_child: np.ndarray
    seg_sequence: np.ndarray
    seq_segment_offsets: np.ndarray
    seq_segments: np.ndarray
    seq_round: np.ndarray
    seq_anchor: np.ndarray
    seq_replay: np.ndarray
    seq_source: np.ndarray
    seq_source_position: np.ndarray
    seq_context: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.seq_round.size)

    @property
    def num_rounds(self) -> int:
        return int(self.seq_round.max()) + 1

    @property
    def total_replay(self) -> int:
        return int(self.seq_replay.sum())

    @property
    def round_replay(self) -> np.ndarray:
        """[num_rounds] replayed positions per round."""
        return np.bincount(self.seq_round, weights=self.seq_replay, minlength=self.num_rounds).astype(np.int64)

    def segments_of(self, n: int) -> np.ndarray:
        return self.seq_segments[self.seq_segment_offsets[n] : self.seq_segment_offsets[n + 1]]


def schedule_sequences(tree: SegmentTree, chunk_size: int, direct_child, *, replay: bool = True) -> CallSchedule:
    """Sequences and earliest legal rounds for a given choice of direct children.

    direct_child: [G] int. With replay, every segment with children must name one of them (a leaf -1). Without
    replay every entry must be -1 (each fork is a sequence boundary, so the state at the fork is a final state).
    """
    B = check_chunk_size(chunk_size)
    G = tree.num_segments
    direct = np.asarray(direct_child, dtype=np.int64)
    if direct.shape != (G,):
        raise ValueError(f"`direct_child` must have one entry per segment ({G}), got shape {direct.shape}")
    if ((direct < -1) | (direct >= G)).any():
        g = int(np.flatnonzero((direct < -1) | (direct >= G))[0])
        raise ValueError(f"direct_child[{g}] = {direct[g]} is not a segment id or -1")
    has_kids = np.diff(tree.child_offsets) > 0
    if replay:
        chosen = np.flatnonzero(direct >= 0)
        is_own_child = np.zeros(G, dtype=bool)
        is_own_child[chosen] = tree.parent[direct[chosen]] == chosen
        bad = np.flatnonzero(np.where(has_kids, ~is_own_child, direct != -1))
        if bad.size:
            g = int(bad[0])
            raise ValueError(
                f"direct_child[{g}] = {direct[g]}: a segment with children must name one of them, a leaf -1"
            )
    elif (direct != -1).any():
        raise ValueError("without replay every fork is a sequence boundary: `direct_child` must be all -1")

    kids, offs = tree.children.tolist(), tree.child_offsets.tolist()
    end, dc = tree.end.tolist(), direct.tolist()
    # Sequences in discovery order (sorted by round, first segment at the end): first segment, anchor, round,
    # source sequence, source position, external path, chain of segments.
    first, anchor, rnd, src, src_pos, context = [], [], [], [], [], []
    chains: list[list[int]] = []

    def add(seg: int, at: int, round_: int, source: int, position: int, path: int) -> None:
        first.append(seg)
        anchor.append(at)
        rnd.append(round_)
        src.append(source)
        src_pos.append(position)
        context.append(path)

    for r in tree.roots.tolist():
        add(r, (int(tree.start[r]) // B) * B if replay else int(tree.start[r]), 0, -1, -1, int(tree.external[r]))
    n = 0
    while n < len(first):
        chain = []
        v = first[n]
        while True:
            chain.append(v)
            for u in kids[offs[v] : offs[v + 1]]:
                if u == dc[v]:
                    continue
                b = (end[v] // B) * B if replay else end[v]
                if b == anchor[n]:  # the state sequence n started from (eq. 11): same source, same round
                    add(u, b, rnd[n], src[n], src_pos[n], context[n])
                else:
                    add(u, b, rnd[n] + 1, n, b, context[n])
            if dc[v] < 0:
                break
            v = dc[v]
        chains.append(chain)
        n += 1

    rnd_arr = np.asarray(rnd, dtype=np.int64)
    perm = np.lexsort((np.asarray(first, dtype=np.int64), rnd_arr))  # new sequence i = old sequence perm[i]
    new_id = inverse_permutation(perm)
    src_arr = np.asarray(src, dtype=np.int64)[perm]
    src_arr = np.where(src_arr >= 0, new_id[np.maximum(src_arr, 0)], -1)
    lengths = np.fromiter((len(chains[i]) for i in perm), dtype=np.int64, count=perm.size)
    seg_offsets = offsets(lengths)
    segments = np.fromiter((g for i in perm.tolist() for g in chains[i]), dtype=np.int64, count=G)
    seg_sequence = np.empty(G, dtype=np.int64)
    seg_sequence[segments] = np.repeat(np.arange(perm.size), lengths)
    anchor_arr = np.asarray(anchor, dtype=np.int64)[perm]
    return CallSchedule(
        tree=tree,
        chunk_size=B,
        replay=replay,
        direct_child=direct,
        seg_sequence=seg_sequence,
        seq_segment_offsets=seg_offsets,
        seq_segments=segments,
        seq_round=rnd_arr[perm],
        seq_anchor=anchor_arr,
        seq_replay=tree.start[segments[seg_offsets[:-1]]] - anchor_arr,
        seq_source=src_arr,
        seq_source_position=np.asarray(src_pos, dtype=np.int64)[perm],
        seq_context=np.asarray(context, dtype=np.int64)[perm],
    )


def min_call_schedule(tree: SegmentTree, chunk_size: int = 64) -> CallSchedule:
    """HARTS Algorithm 1: the schedule with the fewest rounds (max T_pre over roots); its replay is R (eq. 15)."""
    t_pre, t_in = min_calls(tree, chunk_size)
    schedule = schedule_sequences(tree, chunk_size, direct_children(tree, chunk_size, t_pre, t_in))
    assert schedule.num_rounds == int(t_pre[tree.roots].max()), "recovery did not attain T_pre(root)"
    assert schedule.total_replay == mandatory_replay(tree, chunk_size), "replay differs from eq. 15"
    return schedule


def no_replay_schedule(tree: SegmentTree, chunk_size: int = 64) -> CallSchedule:
    """The no-replay ablation: every segment its own sequence, started from its parent's final state at the fork."""
    return schedule_sequences(tree, chunk_size, np.full(tree.num_segments, -1, dtype=np.int64), replay=False)
