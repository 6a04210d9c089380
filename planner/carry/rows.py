"""Rows of a planning unit from pack's sorted order and adjacent LCPs, without building its trie.

Legend: N trajectories of a step at ranks of pack's order (`planner.lcp_index.lexicographic_lcp(..., byteorder=">")`),
n trajectories of one unit, R its rows.

A *unit* is a contiguous rank range [lo, hi) of that order. Its rows are those of `planner.pack.pack` of its
trajectories, numbered in pack's preorder: restricted to a rank range the order and the adjacent LCPs stay the same
(the unit's first trajectory shares nothing, lcp 0), so the trajectory at local rank j contributes the rows
[base[j], base[j] + new[j]) for its positions [lcp[j], length[j]) (new = length - lcp). The row at position q of the
trajectory at local rank j is in the contribution of the last local rank i <= j with lcp[i] <= q; the parent of
contribution j's first row (position lcp[j] - 1) is therefore in contribution prev[j], the last i < j with
lcp[i] < lcp[j], and the chain j, prev[j], prev[prev[j]], ... gives a row's root path as a few row ranges.
"""

from __future__ import annotations

import numpy as np

from planner.index_arrays import offsets

__all__ = ["UnitRows"]


def _previous_smaller(lcp: np.ndarray) -> np.ndarray:
    """[n] int64: the last i < j with lcp[i] < lcp[j], -1 where none (lcp[0] = 0 is below every positive lcp)."""
    prev = np.full(lcp.size, -1, dtype=np.int64)
    stack: list[int] = []
    values = lcp.tolist()
    for j, value in enumerate(values):
        while stack and values[stack[-1]] >= value:
            stack.pop()
        if stack:
            prev[j] = stack[-1]
        stack.append(j)
    return prev


class UnitRows:
    """Row arithmetic of one unit (pack's preorder rows of its trajectories).

    Attributes ([n] int64 by local rank unless noted):
        lo, hi: the unit's rank range in the step's order.
        lcp: adjacent LCPs with lcp[0] = 0. length: trajectory lengths. base [n+1]: first row of each contribution.
        prev: contribution holding the parent of each contribution's first row (-1: the first row is a root).
        parent_of_first: that parent row (-1 for a root).
        num_rows: R.
    """

    def __init__(self, lo: int, hi: int, lcp: np.ndarray, length: np.ndarray):
        self.lo, self.hi = int(lo), int(hi)
        self.lcp = np.asarray(lcp, dtype=np.int64).copy()
        self.lcp[0] = 0
        self.length = np.asarray(length, dtype=np.int64)
        new = self.length - self.lcp
        self.base = offsets(new)
        self._end = self.base[1:]
        self.num_rows = int(self.base[-1])
        self.prev = _previous_smaller(self.lcp)
        has_parent = self.prev >= 0
        self.parent_of_first = np.full(self.lcp.size, -1, dtype=np.int64)
        p = self.prev[has_parent]
        self.parent_of_first[has_parent] = self.base[p] + self.lcp[has_parent] - 1 - self.lcp[p]

    def contribution(self, rows) -> np.ndarray:
        """Local rank whose contribution holds each row (rows in [0, R))."""
        return np.searchsorted(self._end, rows, side="right")

    def positions(self, rows) -> np.ndarray:
        """Position (depth on its paths) of each row: pack's `positions[rows]`."""
        rows = np.asarray(rows, dtype=np.int64)
        j = self.contribution(rows)
        return self.lcp[j] + rows - self.base[j]

    def ancestor_ranges(self, row: int) -> list[tuple[int, int]]:
        """The root path of `row` without the row itself, as row ranges [start, stop), deepest first. Their lengths
        sum to the row's position."""
        j = int(self.contribution(row))
        top = int(self.lcp[j] + row - self.base[j]) - 1  # deepest ancestor position still to cover
        ranges = []
        while top >= 0:
            first = int(self.lcp[j])
            if top >= first:
                start = int(self.base[j])
                ranges.append((start, start + top - first + 1))
            top = first - 1
            j = int(self.prev[j])
        return ranges

    def entry_positions(self, start: int, stop: int) -> np.ndarray:
        """Positions of the rows of [start, stop) whose parent lies before `start` (the rows that continue a path of
        earlier rows; a root is none), in row order."""
        first = int(self.positions(start))
        lo = int(self.contribution(start)) + 1
        hi = int(np.searchsorted(self.base[:-1], stop, side="left"))
        j = np.arange(lo, hi)
        j = j[(self.base[j] < self._end[j]) & (self.parent_of_first[j] >= 0) & (self.parent_of_first[j] < start)]
        later = self.lcp[j]
        return np.concatenate([[first], later]) if first > 0 else later

    def mid_path(self, rows) -> np.ndarray:
        """[M] bool for rows 0 < b < R: row b is the first child of row b - 1 (a cut before b splits a path)."""
        rows = np.asarray(rows, dtype=np.int64)
        return self.positions(rows) == self.positions(rows - 1) + 1
