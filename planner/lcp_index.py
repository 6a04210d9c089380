"""Lexicographic order + adjacent LCP + a sparse table: O(1) compact work of any interval and LCP of any pair.

Legend: N trajectories; a *rank* is a position in the lexicographic order (rank r holds trajectory order[r]).

For trajectories x_0 <= ... <= x_{N-1} in lexicographic order, lcp[r] = LCP(x_{r-1}, x_r) (lcp[0] = 0). Then
  * LCP(x_a, x_b) = min(lcp[a+1 .. b]) for a < b (a range-minimum query, answered by the sparse table in O(1));
  * the compact work (unique trie tokens, HARTS eq. 5) of the interval x_a .. x_b is
    |x_a| + sum_{a<i<=b} (|x_i| - lcp[i]) = P[b+1] - P[a] + lcp[a] with P the prefix sum of |x_i| - lcp[i];
  * the work of any set of ranks r_1 < ... < r_k is |x_{r_1}| + sum_i (|x_{r_i}| - LCP(x_{r_{i-1}}, x_{r_i})).
Any order in which every trie subtree is contiguous has these properties; the index sorts by the native-endian bytes
of the uint32 token ids (a fixed permutation of the token alphabet), which is still a depth-first order of the trie (a
proper prefix sorts before its extensions). No token-level trie is built. `lexicographic_lcp` computes the order and
the adjacent LCPs for the index and for `planner.pack`, which sorts by the big-endian bytes (by token id) instead.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from planner.index_arrays import floor_log2, inverse_permutation, offsets
from planner.trajectory import Trajectory

__all__ = ["LcpIndex", "lexicographic_lcp"]


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    # Compare in growing blocks: adjacent paths often share a long prefix, but most of the work is in the first block.
    start, block = 0, 4096
    while start < n:
        stop = min(n, start + block)
        neq = a[start:stop] != b[start:stop]
        if neq.any():
            return start + int(neq.argmax())
        start, block = stop, block * 4
    return n


def lexicographic_lcp(
    token_lists: Sequence[np.ndarray], *, byteorder: Literal[">", "="]
) -> tuple[np.ndarray, np.ndarray]:
    """Stable lexicographic order of token sequences by the bytes of their uint32 ids, and the adjacent LCPs.

    byteorder ">" (big-endian) sorts by token id, "=" (native-endian) by a fixed permutation of the token alphabet with
    cheaper keys. Both are depth-first orders of the trie but order siblings differently, so they give different trie
    layouts and different contiguous partitions.
    Returns order [N] int64 (the sequence at each rank; equal sequences keep their input order) and lcp [N] int64,
    lcp[j] = LCP(order[j-1], order[j]) and lcp[0] = 0. O(total tokens) besides the sort.
    """
    keys = [np.asarray(t).astype(f"{byteorder}u4").tobytes() for t in token_lists]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    views = [np.frombuffer(k, dtype=np.uint32) for k in keys]  # no copy; equal words are equal tokens in either order
    lcp = np.zeros(len(order), dtype=np.int64)
    for j in range(1, len(order)):
        lcp[j] = _first_mismatch(views[order[j - 1]], views[order[j]])
    return np.asarray(order, dtype=np.int64), lcp


class LcpIndex:
    """Trajectories in lexicographic order with adjacent LCPs and an O(1) range-minimum index.

    Attributes ([N] int64, indexed by rank unless noted):
        order: trajectory index at each rank.
        rank: [N] by trajectory index, its rank.
        lengths: token count of the trajectory at each rank.
        lcp: lcp[r] = LCP(rank r-1, rank r), lcp[0] = 0.
        prefix: [N+1] prefix sums of lengths - lcp, so interval work is prefix[b+1] - prefix[a] + lcp[a].
        total_work: compact work of all trajectories together (G in HARTS eq. 7).
    """

    def __init__(self, order: np.ndarray, lengths_by_index: np.ndarray, lcp: np.ndarray):
        self.order = np.asarray(order, dtype=np.int64)
        n = self.order.size
        self.rank = inverse_permutation(self.order)
        self.lengths = np.asarray(lengths_by_index, dtype=np.int64)[self.order]
        self.lcp = np.asarray(lcp, dtype=np.int64)
        self.prefix = offsets(self.lengths - self.lcp)
        self.total_work = int(self.prefix[-1])
        self._floors = None
        # table[j, i] = min(lcp[i : i + 2**j]) where i + 2**j <= N (the rest is never read).
        levels = max(1, n.bit_length())
        self._table = np.empty((levels, max(n, 1)), dtype=np.int64)
        self._table[0, :n] = self.lcp
        for j in range(1, levels):
            span = 1 << (j - 1)
            self._table[j, : n - 2 * span + 1] = np.minimum(
                self._table[j - 1, : n - 2 * span + 1], self._table[j - 1, span : n - span + 1]
            )

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory] | Sequence[np.ndarray]) -> "LcpIndex":
        """Sort token sequences (Trajectory objects or 1-D int arrays) and compute adjacent LCPs. O(total tokens)."""
        tokens = [t.tokens if isinstance(t, Trajectory) else np.asarray(t) for t in trajectories]
        order, lcp = lexicographic_lcp(tokens, byteorder="=")
        lengths = np.fromiter((t.size for t in tokens), dtype=np.int64, count=len(tokens))
        return cls(order, lengths, lcp)

    def floor_windows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where LCP with rank r stops changing, for every r ([N] int64 each, cached): LCP(j, r) = floor_left[r]
        for every j < stop_left[r], and LCP(r, j) = floor_right[r] for every j >= stop_right[r]
        (floor_left[0] = 0 with stop_left[0] = 0; floor_right[N-1] = 0 with stop_right[N-1] = N)."""
        if self._floors is None:
            n = self.size
            idx = np.arange(n, dtype=np.int64)
            floor_left = np.zeros(n, dtype=np.int64)
            stop_left = np.zeros(n, dtype=np.int64)
            if n > 1:
                floor_left[1:] = np.minimum.accumulate(self.lcp[1:])
                at_min = np.zeros(n, dtype=bool)
                at_min[1:] = self.lcp[1:] == floor_left[1:]
                stop_left = np.maximum.accumulate(np.where(at_min, idx, 0))
            floor_right = np.zeros(n, dtype=np.int64)
            stop_right = np.full(n, n, dtype=np.int64)
            if n > 1:
                suffix = np.minimum.accumulate(self.lcp[:0:-1])[::-1]  # suffix[i - 1] = min(lcp[i:])
                floor_right[:-1] = suffix
                at_min = np.zeros(n, dtype=bool)
                at_min[1:] = self.lcp[1:] == suffix
                first = np.minimum.accumulate(np.where(at_min, idx, n)[::-1])[::-1]  # first at_min index >= i
                stop_right[:-1] = first[1:]
            self._floors = (stop_left, floor_left, stop_right, floor_right)
        return self._floors

    @property
    def size(self) -> int:
        return int(self.order.size)

    def range_min(self, lo, hi):
        """min(lcp[lo .. hi]) (inclusive), scalars or equal-shape int arrays with lo <= hi."""
        if np.ndim(lo) == 0 and np.ndim(hi) == 0:
            j = (int(hi) - int(lo) + 1).bit_length() - 1
            return int(min(self._table[j, int(lo)], self._table[j, int(hi) - (1 << j) + 1]))
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        j = floor_log2(hi - lo + 1)
        return np.minimum(self._table[j, lo], self._table[j, hi - (1 << j) + 1])

    def pair_lcp(self, a, b):
        """LCP of the trajectories at ranks a and b (scalars or arrays, any order; LCP(x, x) = |x|)."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        if lo.ndim == 0:
            return int(self.lengths[lo]) if lo == hi else self.range_min(lo + 1, hi)
        out = self.lengths[lo].copy()
        differ = lo != hi
        if differ.any():
            out[differ] = self.range_min(lo[differ] + 1, hi[differ])
        return out

    def interval_work(self, a, b):
        """Compact work of the ranks a .. b inclusive (scalars or arrays)."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        work = self.prefix[b + 1] - self.prefix[a] + self.lcp[a]
        return int(work) if work.ndim == 0 else work

    def sorted_work(self, ranks: np.ndarray) -> int:
        """Compact work of strictly increasing ranks [M] (set_work without sorting)."""
        if ranks.size == 1:
            return int(self.lengths[ranks[0]])
        return int(self.lengths[ranks].sum() - self.range_min(ranks[:-1] + 1, ranks[1:]).sum())

    def set_work(self, ranks) -> int:
        """Compact work of any set of ranks (HARTS eq. 5); duplicates are counted once."""
        r = np.unique(np.asarray(ranks, dtype=np.int64))
        if r.size == 0:
            return 0
        if r.size == 1:
            return int(self.lengths[r[0]])
        shared = self.range_min(r[:-1] + 1, r[1:])
        return int(self.lengths[r].sum() - shared.sum())
