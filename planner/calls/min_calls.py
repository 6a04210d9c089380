"""HARTS Algorithm 1: the minimum number of sequential linear-attention calls of a segment tree, and how to attain it.

Execution model (HARTS §3.3). Each packed input sequence starts at a chunk-aligned anchor and follows a chain of
direct continuations; at a fork exactly one child continues the sequence, every other child (side branch) starts a
new sequence from the state at b_v = a(e_v) = floor(e_v/B)*B and replays the ancestor rows [b_v, e_v) first. A state
produced inside a call can start another sequence only in a later call; the state a sequence started from is
available in its own round. With a_v = a(s_v), a side branch can therefore join its parent's round exactly when the
parent's entry state was ready before the round and e_v < a_v + B (eq. 11); otherwise it waits one round.

    T_pre(v): minimum rounds for v's subtree when S_{a_v} is available before the round (eq. 14),
    T_in(v):  minimum rounds when v's entry state arrives inside the current call (eq. 13),
    leaves: T_pre = T_in = 1 (eq. 12).

`min_calls` is the postorder pass (largest and second-largest child T_pre give every h_o); `direct_children` is the
recovery pass (root budget K_round, side budget K_side, count f). Both are iterative and O(G).
"""

from __future__ import annotations

import numpy as np

from planner.calls.segment_tree import SegmentTree

__all__ = ["min_calls", "direct_children", "mandatory_replay", "check_chunk_size"]


def check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def _fits_in_entry_chunk(tree: SegmentTree, B: int) -> list[bool]:
    """[G] e_v < a_v + B: the segment crosses no chunk boundary after its entry anchor (eq. 11)."""
    return (tree.end < (tree.start // B) * B + B).tolist()


def min_calls(tree: SegmentTree, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """T_pre and T_in of every segment ([G] int64 each). A tree needs T_pre[root] calls; a forest the max over roots."""
    B = check_chunk_size(chunk_size)
    G = tree.num_segments
    kids, offs = tree.children.tolist(), tree.child_offsets.tolist()
    fits = _fits_in_entry_chunk(tree, B)
    t_pre, t_in = [1] * G, [1] * G
    for v in reversed(tree.order.tolist()):
        ch = kids[offs[v] : offs[v + 1]]
        if not ch:
            continue
        # h_o = max over the other children of T_pre: the largest, or the second largest for the argmax child.
        first = second = 0
        arg = -1
        for u in ch:
            t = t_pre[u]
            if t > first:
                first, second, arg = t, first, u
            elif t > second:
                second = t
        best = min(max(t_in[o], 1 + (second if o == arg else first)) for o in ch)
        t_in[v] = best
        t_pre[v] = first if fits[v] else best
    return np.asarray(t_pre, dtype=np.int64), np.asarray(t_in, dtype=np.int64)


def direct_children(tree: SegmentTree, chunk_size: int, t_pre: np.ndarray, t_in: np.ndarray) -> np.ndarray:
    """Recovery: the child that directly continues each segment's sequence ([G] int64, -1 for a leaf).

    Propagates the round budget from each root (K_round = T_pre[root]); at a segment entered with `ready` state,
    `same` = ready and e_v < a_v + B, K_side = K_round - (0 if same else 1), and the direct child is the first child o
    (in increasing id) with H[o] <= K_round whose removal leaves no child above the side budget (f - [T_pre[o] >
    K_side] = 0), where H = T_pre if same else T_in. Side children are entered ready with budget K_side.
    """
    B = check_chunk_size(chunk_size)
    kids, offs = tree.children.tolist(), tree.child_offsets.tolist()
    fits = _fits_in_entry_chunk(tree, B)
    pre, tin = t_pre.tolist(), t_in.tolist()
    direct = [-1] * tree.num_segments
    stack = [(int(r), True, pre[r]) for r in tree.roots]
    while stack:
        v, ready, k_round = stack.pop()
        ch = kids[offs[v] : offs[v + 1]]
        if not ch:
            continue
        same = ready and fits[v]
        k_side = k_round - (0 if same else 1)
        height = pre if same else tin
        f = sum(pre[u] > k_side for u in ch)
        o = next((o for o in ch if height[o] <= k_round and f - (pre[o] > k_side) == 0), None)
        assert o is not None, f"recovery found no direct child of segment {v} within budget {k_round}"
        direct[v] = o
        stack.append((o, same, k_round))
        stack.extend((u, True, k_side) for u in ch if u != o)
    return np.asarray(direct, dtype=np.int64)


def mandatory_replay(tree: SegmentTree, chunk_size: int) -> int:
    """R = sum over internal v of (|ch(v)| - 1) * (e_v mod B) (HARTS eq. 15), independent of the direct children,
    plus s_r mod B for every external root r (it replays its outside path's rows [a(s_r), s_r))."""
    B = check_chunk_size(chunk_size)
    n_children = np.diff(tree.child_offsets)
    return int(np.sum(np.maximum(n_children - 1, 0) * (tree.end % B)) + np.sum(tree.start[tree.roots] % B))
