"""Trie packing: trajectories -> one compact layout in which every unique (prefix, token) is a single row.

Legend: N trajectories, S semantic positions (all tokens of all trajectories, original order), C compact rows,
G segments (maximal fork-free token paths of the trie).

The trie is built from the lexicographic order of the trajectories by token id (planner.lcp_index.lexicographic_lcp).
In that order the longest prefix a trajectory shares with *any* earlier one is the one it shares with its immediate
predecessor (adjacent LCP), so trajectory j contributes exactly its tokens [LCP_j, L_j) as new rows, and the
concatenation of these contributions is a depth-first preorder of the trie. In preorder every segment is a contiguous
row range and every subtree is a contiguous range [row, subtree_end[row]). All work is per trajectory or vectorised
over rows: no Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from planner.index_arrays import offsets
from planner.lcp_index import lexicographic_lcp
from planner.trajectory import Trajectory, check_trajectories

__all__ = ["CompactBatch", "pack"]


@dataclass(eq=False)
class CompactBatch:
    """A batch of trajectories packed into a trie. All arrays are numpy; rows are in trie preorder.

    Compact rows ([C]):
        tokens: token id of the row.
        positions: depth of the row on its original path (0-based; RoPE and chunk geometry use it).
        parent: parent row, -1 for a trie root.
        multiplicity: q, the number of semantic positions mapped to the row (sum = S).
        subtree_end: exclusive end of the row's subtree; row r is an ancestor-or-self of row c iff
            r <= c < subtree_end[r].
        segment: segment index of the row.
    Segments ([G], maximal fork-free paths; a child segment starts where its parent forks):
        seg_offsets [G+1]: segment g owns rows [seg_offsets[g], seg_offsets[g+1]).
        seg_parent: parent segment, -1 for a root segment.
        seg_start, seg_end: position interval [start, end) of the segment; for a child, seg_start is its fork position.
        (Derived segment structure, e.g. depth and children: planner.calls.segment_tree.SegmentTree.from_batch.)
    Semantic positions ([S], original trajectory order, trajectory i at [traj_offsets[i], traj_offsets[i+1])):
        sem_to_compact: the map m, row of each semantic position.
        logit_row: row whose logits predict this position's token (m of the previous position), -1 for a first token.
        sem_tokens, loss_mask, advantage; logprobs and ref_logprobs are None when no trajectory
        has them, else NaN where a trajectory lacks them. `weight` and `traj_index` [S] are computed on access.
    """

    tokens: np.ndarray
    positions: np.ndarray
    parent: np.ndarray
    multiplicity: np.ndarray
    subtree_end: np.ndarray
    segment: np.ndarray
    seg_offsets: np.ndarray
    seg_parent: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray
    traj_offsets: np.ndarray
    sem_to_compact: np.ndarray
    logit_row: np.ndarray
    sem_tokens: np.ndarray
    loss_mask: np.ndarray
    advantage: np.ndarray
    logprobs: np.ndarray | None
    ref_logprobs: np.ndarray | None
    trajectories: Sequence[Trajectory]

    @property
    def num_compact(self) -> int:
        return int(self.tokens.size)

    @property
    def num_semantic(self) -> int:
        return int(self.sem_tokens.size)

    @property
    def num_segments(self) -> int:
        return int(self.seg_parent.size)

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_offsets.size - 1)

    @property
    def lengths(self) -> np.ndarray:
        """[N] trajectory lengths."""
        return np.diff(self.traj_offsets)

    @property
    def traj_index(self) -> np.ndarray:
        """[S] trajectory of each semantic position (computed on access)."""
        return np.repeat(np.arange(self.num_trajectories, dtype=np.int64), self.lengths)

    @property
    def weight(self) -> np.ndarray:
        """[S] loss weight of each semantic position's trajectory (computed on access)."""
        return np.repeat(np.array([t.weight for t in self.trajectories], dtype=np.float64), self.lengths)

    @property
    def compression(self) -> float:
        """Semantic tokens per compact row (S / C)."""
        return self.num_semantic / self.num_compact

    @property
    def max_depth(self) -> int:
        """Length of the longest root-to-leaf path (tokens)."""
        return int(self.positions.max()) + 1


def pack(trajectories: Sequence[Trajectory], *, share: bool = True) -> CompactBatch:
    """Merge identical token prefixes of `trajectories` (from any number of trees) into one trie.

    Two positions share a row iff their whole token prefixes (including the token itself) are identical; tree ids do
    not matter. With `share=False` nothing is merged: every trajectory is a path of its own, in input order (the
    flat expansion, which tree execution runs as trajectory-wise training). Returns a CompactBatch whose semantic
    arrays follow the input order.
    """
    if len(trajectories) == 0:
        raise ValueError("pack() needs at least one trajectory, got an empty list")
    check_trajectories(trajectories)
    toks = [t.tokens for t in trajectories]
    n = len(toks)
    lengths = np.fromiter((x.size for x in toks), dtype=np.int64, count=n)
    traj_offsets = offsets(lengths)
    S = int(traj_offsets[-1])

    if share:
        order, lcp = lexicographic_lcp(toks, byteorder=">")
    else:
        order, lcp = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    new = lengths[order] - lcp  # rows contributed by each trajectory in sorted order
    base = offsets(new)
    C = int(base[-1])

    # The map m, written trajectory by trajectory in sorted order: shared prefix copied from the predecessor.
    m = np.empty(S, dtype=np.int64)
    parent_of_first = np.full(n, -1, dtype=np.int64)
    prev_off = 0
    for j in range(n):
        i = order[j]
        off, length, shared = traj_offsets[i], lengths[i], lcp[j]
        if shared:
            m[off : off + shared] = m[prev_off : prev_off + shared]
            parent_of_first[j] = m[prev_off + shared - 1]
        m[off + shared : off + length] = np.arange(base[j], base[j] + length - shared)
        prev_off = off

    sorted_tokens = [toks[i][lcp[j] :] for j, i in enumerate(order)]
    tokens = np.concatenate(sorted_tokens).astype(np.int64, copy=False) if C else np.zeros(0, np.int64)
    positions = np.arange(C, dtype=np.int64) - np.repeat(base[:-1] - lcp, new)
    parent = np.arange(C, dtype=np.int64) - 1
    has_rows = new > 0
    parent[base[:-1][has_rows]] = parent_of_first[has_rows]
    multiplicity = np.bincount(m, minlength=C).astype(np.int64)

    # Segments: a row starts one iff it is a root or its parent has several children.
    num_children = np.bincount(parent[parent >= 0], minlength=C)
    is_start = parent < 0
    is_start[~is_start] = num_children[parent[~is_start]] >= 2
    starts = np.flatnonzero(is_start)
    G = starts.size
    seg_offsets = np.append(starts, C).astype(np.int64)
    segment = np.cumsum(is_start) - 1
    seg_parent = np.where(parent[starts] >= 0, segment[np.maximum(parent[starts], 0)], -1)
    seg_start = positions[starts]
    seg_end = positions[seg_offsets[1:] - 1] + 1

    # Preorder: a parent segment precedes its children, so subtree ends are one backward pass.
    par = seg_parent.tolist()
    sub_end = seg_offsets[1:].tolist()
    for g in range(G - 1, -1, -1):
        p = par[g]
        if p >= 0 and sub_end[g] > sub_end[p]:
            sub_end[p] = sub_end[g]
    subtree_end = np.asarray(sub_end, dtype=np.int64)[segment]

    logit_row = np.empty(S, dtype=np.int64)
    logit_row[1:] = m[:-1]
    logit_row[traj_offsets[:-1]] = -1

    loss_mask = np.concatenate([t.loss_mask for t in trajectories])
    loss_mask[traj_offsets[:-1]] = False  # a first token is never predicted

    def cat_optional(name: str) -> np.ndarray | None:
        parts = [getattr(t, name) for t in trajectories]
        if all(p is None for p in parts):
            return None
        return np.concatenate([p if p is not None else np.full(len(t), np.nan) for p, t in zip(parts, trajectories)])

    return CompactBatch(
        tokens=tokens,
        positions=positions,
        parent=parent,
        multiplicity=multiplicity,
        subtree_end=subtree_end,
        segment=segment.astype(np.int64),
        seg_offsets=seg_offsets,
        seg_parent=seg_parent.astype(np.int64),
        seg_start=seg_start.astype(np.int64),
        seg_end=seg_end.astype(np.int64),
        traj_offsets=traj_offsets,
        sem_to_compact=m,
        logit_row=logit_row,
        sem_tokens=np.concatenate(toks).astype(np.int64, copy=False),
        loss_mask=loss_mask,
        advantage=np.concatenate([t.advantage for t in trajectories]),
        logprobs=cat_optional("logprobs"),
        ref_logprobs=cat_optional("ref_logprobs"),
        trajectories=trajectories,
    )
