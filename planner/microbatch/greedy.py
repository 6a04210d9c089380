"""Trie-aware greedy microbatch construction (HARTS §3.2), independent of contiguity and of a fixed K.

Legend: N trajectories at lexicographic ranks 0..N-1 (planner/lcp_index.py), K microbatches, T capacity, D DP degree.
Trajectories are inserted one by one in a processing order; inserting x into a microbatch adds |x| minus the longest
prefix x shares with a member (HARTS eq. 10). That member is x's nearest member on one side in lexicographic order, and
beyond the last lowest adjacent-LCP valley on each side every rank shares the same floor with x
(LcpIndex.floor_windows), so only members inside that window are looked at.
"""

from __future__ import annotations

import numpy as np

from planner.lcp_index import LcpIndex
from planner.microbatch.refine import Grouping, align_k, eliminate_small, shared_prefix

__all__ = ["processing_orders", "greedy_grouping", "trie_greedy"]

POLICIES = ("best_fit", "max_shared")


def processing_orders(index: LcpIndex) -> dict[str, np.ndarray]:
    """HARTS's four processing orders (as rank arrays): ascending and descending lexicographic, descending length, and
    descending unique suffix u(x) = |x| - max(LCP with its two global lexicographic neighbours)."""
    n = index.size
    ranks = np.arange(n, dtype=np.int64)
    right = np.append(index.lcp[1:], 0)
    unique = index.lengths - np.maximum(index.lcp, right)
    return {
        "lex": ranks,
        "lex_desc": ranks[::-1].copy(),
        "length_desc": np.lexsort((ranks, -index.lengths)),
        "unique_desc": np.lexsort((ranks, -unique)),
    }


def greedy_grouping(index: LcpIndex, capacity: int, order: np.ndarray, policy: str) -> Grouping:
    """Insert the ranks in `order` one by one. Among capacity-feasible microbatches, "best_fit" picks the one with the
    most work after insertion and "max_shared" the one sharing the longest prefix (ties: most work after); a new
    microbatch is opened when none fits."""
    if policy not in POLICIES:
        raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}")
    n = index.size
    owner = np.full(n, -1, dtype=np.int64)
    work = np.zeros(n, dtype=np.int64)
    lo_rank = np.full(n, n, dtype=np.int64)
    hi_rank = np.full(n, -1, dtype=np.int64)
    k = 0
    for r in order.tolist():
        if k:
            shared = shared_prefix(index, owner, lo_rank[:k], hi_rank[:k], r)
            after = work[:k] + index.lengths[r] - shared
            fits = np.flatnonzero(after <= capacity)
        else:
            fits = np.zeros(0, dtype=np.int64)
        if fits.size == 0:
            m = k
            k += 1
            work[m] = index.lengths[r]
        else:
            if policy == "best_fit":
                m = fits[np.argmax(after[fits])]
            else:
                m = fits[np.lexsort((-after[fits], -shared[fits]))[0]]
            work[m] = after[m]
        owner[r] = m
        lo_rank[m] = min(lo_rank[m], r)
        hi_rank[m] = max(hi_rank[m], r)
    g = Grouping.__new__(Grouping)
    g.index, g.owner, g.work = index, owner, work[:k].copy()
    return g


def trie_greedy(index: LcpIndex, capacity: int, dp: int, tries: int = 8) -> tuple[str, Grouping] | None:
    """HARTS's greedy candidate: 4 processing orders x 2 policies; each plan eliminates light microbatches (at no work
    increase, `tries` failed attempts in a row at most) and aligns K to `dp`; the plan with the fewest microbatches,
    then the least work, is returned with its name (None if no plan could be aligned)."""
    best = None
    for name, order in processing_orders(index).items():
        for policy in POLICIES:
            g = greedy_grouping(index, capacity, order, policy)
            reduced = eliminate_small(g, capacity, 1, tries=tries)[-1]
            aligned = align_k(reduced, dp)
            if aligned is None:
                continue
            key = (aligned.k, aligned.total)
            if best is None or key < best[0]:
                best = (key, f"greedy-{name}-{policy}", aligned)
    return None if best is None else (best[1], best[2])
