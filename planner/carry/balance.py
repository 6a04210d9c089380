"""Planning units and their DP replicas for prefix carry: rank ranges of pack's order, balanced over D replicas.

Legend: N trajectories at ranks of pack's order, lcp [N] adjacent LCPs (lcp[0] = 0), new = length - lcp the rows each
rank adds to the step's trie, U units, D replicas.

All parts of a unit run on one replica (their carried context never crosses replicas). A unit is a rank range
[lo, hi); splitting a range at rank j executes the lcp[j] rows the two sides share twice, so units are only split
where that is cheap:
 1. connected components of the trie (lcp 0) are units; with D > 1 a unit is split further at every rank with its
    smallest internal lcp (its root's children) while there are fewer units than 4 D, if these splits duplicate at most
    `split_budget` of the step's trie rows;
 2. largest-first (LPT) assignment to replicas, then moves and swaps of whole units between the heaviest replica and
    another one while the heavier of the two gets lighter;
 3. while the heaviest replica is more than `tolerance` above the mean: move a prefix or a suffix of one of its
    units (cut at any rank) to the lightest replica, the cut that minimises the new heavier total (then the rows it
    duplicates, which land on the lighter replica), if that total plus those rows is below the heaviest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Unit", "balance_units"]


@dataclass(frozen=True)
class Unit:
    """A rank range [lo, hi) of pack's order, its rows and its replica."""

    lo: int
    hi: int
    rows: int
    replica: int


def _rows(new: np.ndarray, lcp: np.ndarray, lo: int, hi: int) -> int:
    """Rows of pack(ranks lo..hi-1): the first rank contributes its whole length."""
    return int(new[lo:hi].sum() + lcp[lo])


def _split_roots(ranges: list[tuple[int, int]], lcp: np.ndarray, sizes: list[int], budget: int) -> int:
    """Split the largest splittable unit at all ranks with its smallest internal lcp (in place). Returns the rows
    that duplicates, or -1 when no unit can be split within `budget`."""
    for u in np.argsort(sizes)[::-1]:
        lo, hi = ranges[u]
        if hi - lo < 2:
            continue
        inner = lcp[lo + 1 : hi]
        floor = int(inner.min())
        cuts = lo + 1 + np.flatnonzero(inner == floor)
        cost = floor * cuts.size
        if cost > budget:
            continue
        bounds = [lo, *cuts.tolist(), hi]
        ranges[u : u + 1] = list(zip(bounds[:-1], bounds[1:]))
        return cost
    return -1


def _lpt(sizes: np.ndarray, dp: int) -> np.ndarray:
    """Largest-first assignment: each unit to the replica with the least work so far. Returns replica [U]."""
    replica = np.empty(sizes.size, dtype=np.int64)
    total = np.zeros(dp, dtype=np.int64)
    for u in np.argsort(-sizes, kind="stable"):
        d = int(np.argmin(total))
        replica[u] = d
        total[d] += sizes[u]
    return replica


def _imbalance(total: np.ndarray) -> float:
    mean = total.mean()
    return float(total.max() / mean - 1) if mean > 0 else 0.0


def _exchange(sizes: np.ndarray, replica: np.ndarray, dp: int, max_rounds: int = 200) -> None:
    """Moves and swaps of whole units that lower the heavier of the heaviest replica and a partner (in place)."""
    for _ in range(max_rounds):
        total = np.bincount(replica, weights=sizes, minlength=dp).astype(np.int64)
        h = int(np.argmax(total))
        mine = np.flatnonzero(replica == h)
        best = None
        for other in range(dp):
            if other == h or total[other] >= total[h]:
                continue
            theirs = np.flatnonzero(replica == other)
            # moved away from h: one of its units, less one unit of `other` (or none) moved back
            delta = sizes[mine][:, None] - np.append(sizes[theirs], 0)[None, :]
            new_max = np.maximum(total[h] - delta, total[other] + delta)
            i, k = np.unravel_index(np.argmin(new_max), new_max.shape)
            if new_max[i, k] < total[h] and (best is None or new_max[i, k] < best[0]):
                best = (int(new_max[i, k]), int(mine[i]), int(theirs[k]) if k < theirs.size else -1, other)
        if best is None:
            return
        _, x, y, other = best
        replica[x] = other
        if y >= 0:
            replica[y] = h


def _best_cut(ranges: list[tuple[int, int]], replica: np.ndarray, new: np.ndarray, lcp: np.ndarray,
              dp: int) -> tuple[int, int, bool] | None:
    """Step 3's cut: (unit, rank j, whether the prefix moves), or None when no cut lowers the heaviest total by more
    than the rows it duplicates."""
    sizes = np.array([_rows(new, lcp, lo, hi) for lo, hi in ranges], dtype=np.int64)
    total = np.bincount(replica, weights=sizes, minlength=dp).astype(np.int64)
    h, light = int(np.argmax(total)), int(np.argmin(total))
    best = None
    for u in np.flatnonzero(replica == h):
        lo, hi = ranges[u]
        if hi - lo < 2:
            continue
        j = np.arange(lo + 1, hi)
        before = np.cumsum(new[lo : hi - 1]) + lcp[lo]  # rows of ranks lo..j-1
        after = sizes[u] - before  # rows ranks j..hi-1 add, without the lcp[j] rows they share with the rest
        # suffix moves: the light replica runs lcp[j] + after rows; prefix moves: the heavy one keeps lcp[j] + after
        for prefix, heavy, light_total in ((False, total[h] - after, total[light] + after + lcp[j]),
                                           (True, total[h] - before + lcp[j], total[light] + before)):
            new_max = np.maximum(heavy, light_total)
            worth = new_max + lcp[j] < total[h]
            if not worth.any():
                continue
            i = int(np.lexsort((lcp[j], np.where(worth, new_max, np.iinfo(np.int64).max)))[0])
            key = (int(new_max[i]), int(lcp[j][i]))
            if best is None or key < best[0]:
                best = (key, int(u), int(j[i]), prefix)
    return None if best is None else best[1:]


def balance_units(lcp: np.ndarray, length: np.ndarray, dp: int, *, tolerance: float = 2e-4,
                  split_budget: float = 5e-3, max_cuts: int | None = None) -> list[Unit]:
    """Units (rank ranges of pack's order, in rank order) and their replicas (see the module docstring).

    Args:
        lcp: [N] adjacent LCPs of pack's order (lcp[0] = 0); length: [N] trajectory lengths at each rank.
        dp: D replicas.
        tolerance: stop balancing when the heaviest replica is at most this fraction above the mean.
        split_budget: rows step 1 may duplicate, as a fraction of the trie's rows.
        max_cuts: step-3 cuts at most (default 2 D).
    """
    lcp = np.asarray(lcp, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    new = length - lcp
    starts = np.flatnonzero(lcp == 0)
    ranges = list(zip(starts.tolist(), [*starts[1:].tolist(), lcp.size]))
    budget = int(split_budget * new.sum())
    while dp > 1 and len(ranges) < 4 * dp:
        sizes = [_rows(new, lcp, lo, hi) for lo, hi in ranges]
        spent = _split_roots(ranges, lcp, sizes, budget)
        if spent < 0:
            break
        budget -= spent
    sizes = np.array([_rows(new, lcp, lo, hi) for lo, hi in ranges], dtype=np.int64)
    replica = _lpt(sizes, dp)
    _exchange(sizes, replica, dp)
    for _ in range(2 * dp if max_cuts is None else max_cuts):
        sizes = np.array([_rows(new, lcp, lo, hi) for lo, hi in ranges], dtype=np.int64)
        if _imbalance(np.bincount(replica, weights=sizes, minlength=dp)) <= tolerance:
            break
        cut = _best_cut(ranges, replica, new, lcp, dp)
        if cut is None:
            break
        u, j, prefix = cut
        h = int(replica[u])
        light = int(np.argmin(np.bincount(replica, weights=sizes, minlength=dp)))
        lo, hi = ranges[u]
        ranges[u : u + 1] = [(lo, j), (j, hi)]
        replica = np.insert(replica, u + 1, h if prefix else light)
        replica[u] = light if prefix else h
    return [Unit(lo, hi, _rows(new, lcp, lo, hi), int(d)) for (lo, hi), d in zip(ranges, replica)]
