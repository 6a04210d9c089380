"""Contiguous partitions of the lexicographic order (HARTS §3.2): natural partition, K range, exact DP, K evolution.

Legend: N trajectories, ranks 0..N-1 in lexicographic order (planner/lcp_index.py), K microbatches, T capacity.
A contiguous partition is given by `starts` [K] int64: microbatch i holds ranks starts[i] .. starts[i+1]-1
(starts[0] = 0, the last one ends at N-1). By HARTS eq. 6 its total compact work is G + sum(lcp[starts[1:]]):
every cut duplicates exactly the LCP of the two trajectories it separates.
"""

from __future__ import annotations

import heapq

import numpy as np

from planner.index_arrays import floor_log2
from planner.lcp_index import LcpIndex

__all__ = ["natural_partition", "k_candidates", "sample_ks", "exact_dp", "evolve", "best_split", "window_starts"]

_INF = np.iinfo(np.int64).max // 4


def window_starts(index: LcpIndex, capacity: int) -> np.ndarray:
    """lo[e] = the smallest start s with interval_work(s, e) <= capacity, for every end rank e. [N] int64.

    Interval work never grows when the start moves right, so a vectorised bisection finds it. Requires every
    trajectory to fit (interval_work(e, e) = |x_e| <= capacity).
    """
    n = index.size
    ends = np.arange(n, dtype=np.int64)
    lo = np.zeros(n, dtype=np.int64)
    hi = ends.copy()
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        fits = index.interval_work(mid, ends) <= capacity
        hi = np.where(open_ & fits, mid, hi)
        lo = np.where(open_ & ~fits, mid + 1, lo)


def best_split(index: LcpIndex, a: int, b: int) -> tuple[int, int, int, int]:
    """Best cut t in (a, b] of the interval a..b: lowest LCP valley, then the smaller larger side, then the smaller
    difference (HARTS natural-partition tie-breaks). Returns (lcp[t], larger side work, side difference, t)."""
    t = np.arange(a + 1, b + 1, dtype=np.int64)
    left = index.interval_work(np.full_like(t, a), t - 1)
    right = index.interval_work(t, np.full_like(t, b))
    larger = np.maximum(left, right)
    diff = np.abs(left - right)
    i = np.lexsort((diff, larger, index.lcp[t]))[0]
    return int(index.lcp[t[i]]), int(larger[i]), int(diff[i]), int(t[i])


def natural_partition(index: LcpIndex, capacity: int) -> np.ndarray:
    """Recursively split every interval heavier than `capacity` at its best cut (`best_split`). Returns starts [K0]."""
    cuts = []
    stack = [(0, index.size - 1)]
    while stack:
        a, b = stack.pop()
        if index.interval_work(a, b) <= capacity:
            continue
        t = best_split(index, a, b)[3]
        cuts.append(t)
        stack += [(a, t - 1), (t, b)]
    return np.array([0] + sorted(cuts), dtype=np.int64)


def k_candidates(index: LcpIndex, capacity: int, dp: int, k0: int) -> list[int]:
    """HARTS eqs. 7-8: K_min = D max(1, ceil(G / (T D))), K_max = max(K_min, min(D ceil(K0 / D), D floor(N / D))),
    candidates K_min, K_min + D, ..., K_max."""
    k_min = dp * max(1, -(-index.total_work // (capacity * dp)))
    k_max = max(k_min, min(dp * -(-k0 // dp), dp * (index.size // dp)))
    return list(range(k_min, k_max + 1, dp))


def sample_ks(ks: list[int], q_max: int) -> list[int]:
    """At most q_max of the candidate Ks: all if they fit, else both ends, the smallest ones densely (half the budget)
    and the rest spread evenly over the whole range."""
    if len(ks) <= q_max:
        return list(ks)
    dense = ks[: q_max // 2]
    spread = [ks[int(round(i))] for i in np.linspace(0, len(ks) - 1, q_max - len(dense))]
    return sorted(set(dense) | set(spread) | {ks[-1]})


class _ArgminTable:
    """Range argmin over a fixed int64 array: table[j, i] = argmin(values[i : i + 2**j]) (leftmost on ties)."""

    def __init__(self, values: np.ndarray):
        n = values.size
        self.values = values
        self.table = np.empty((max(1, n.bit_length()), n), dtype=np.int64)
        self.table[0] = np.arange(n)
        for j in range(1, self.table.shape[0]):
            span = 1 << (j - 1)
            m = n - 2 * span + 1
            left, right = self.table[j - 1, :m], self.table[j - 1, span : span + m]
            self.table[j, :m] = np.where(values[right] < values[left], right, left)

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        j = floor_log2(hi - lo + 1)
        a, b = self.table[j, lo], self.table[j, hi - (1 << j) + 1]
        return np.where(self.values[b] < self.values[a], b, a)


def exact_dp(index: LcpIndex, capacity: int, dp: int) -> np.ndarray | None:
    """The minimum-work contiguous partition into nonempty capacity-feasible intervals whose count K is a multiple
    of `dp`, over every such K (not only HARTS's eq.-8 range). Returns its starts, or None if no K works.

    HARTS eq. 9 indexes the table by K; we index it by K mod D. G[r, e] = the least cut cost (eq. 6: the work of a
    partition is G plus its cut LCPs) of covering ranks 0..e with a number of intervals = r (mod D):
        G[r, e] = min over feasible starts s of G[r-1, s-1] + lcp[s]   (and 0 for r = 1 if 0..e fits).
    A start s only reads entries of smaller end ranks, so relaxing the D residues in turn until nothing changes
    converges after about K*/D sweeps; each pass is a vectorised range-minimum query (a sparse table over the
    candidates' keys) restricted to the starts whose predecessor entry improved in the previous pass. Ties on the
    work prefer the smaller heaviest microbatch of the prefix partition (HARTS breaks ties by the heaviest microbatch
    of the whole partition; boundary refinement then rebalances).
    """
    n = index.size
    ends = np.arange(n, dtype=np.int64)
    lo = window_starts(index, capacity)
    first = np.maximum(lo, 1)
    whole = lo == 0  # 0..e is one feasible interval
    weight = capacity + 1
    cost = np.full((dp, n), _INF, dtype=np.int64)
    heavy = np.full((dp, n), _INF, dtype=np.int64)
    choice = np.full((dp, n), -1, dtype=np.int64)  # start of the last interval; 0 = a single interval
    base = 1 % dp
    cost[base, whole] = 0
    heavy[base, whole] = index.interval_work(np.zeros(int(whole.sum()), dtype=np.int64), ends[whole])
    choice[base, whole] = 0
    # dirty[r] = (lo, hi): the ends whose entry of residue r improved since residue r + 1 last read it. Keys only
    # improve, so a pass only needs the starts s with s - 1 in the previous residue's dirty range.
    dirty: list[tuple[int, int] | None] = [None] * dp
    if whole.any():
        dirty[base] = (0, int(np.flatnonzero(whole)[-1]))
    while any(d is not None for d in dirty):
        for r in list(range(1, dp)) + [0]:
            prev = (r - 1) % dp
            if dirty[prev] is None:
                continue
            s_lo, s_hi = dirty[prev][0] + 1, min(dirty[prev][1] + 1, n - 1)
            dirty[prev] = None
            if s_lo > s_hi:
                continue
            e_hi = int(np.searchsorted(first, s_hi, side="right")) - 1
            e = np.arange(s_lo, e_hi + 1, dtype=np.int64)
            if e.size == 0:
                continue
            start = np.maximum(first[e], s_lo)
            stop = np.minimum(e, s_hi)
            e, start, stop = e[start <= stop], start[start <= stop], stop[start <= stop]
            prev_cost = cost[prev, s_lo - 1 : s_hi]
            ok = prev_cost < _INF
            key = np.full(s_hi - s_lo + 1, _INF, dtype=np.int64)
            key[ok] = (prev_cost[ok] + index.lcp[s_lo : s_hi + 1][ok]) * weight + heavy[prev, s_lo - 1 : s_hi][ok]
            s = _ArgminTable(key).query(start - s_lo, stop - s_lo) + s_lo
            reach = key[s - s_lo] < _INF
            e, s = e[reach], s[reach]
            new_cost = cost[prev, s - 1] + index.lcp[s]
            new_heavy = np.maximum(heavy[prev, s - 1], index.interval_work(s, e))
            cur = cost[r, e]
            better = (new_cost < cur) | ((new_cost == cur) & (new_heavy < heavy[r, e]))
            if better.any():
                e = e[better]
                cost[r, e] = new_cost[better]
                heavy[r, e] = new_heavy[better]
                choice[r, e] = s[better]
                old = dirty[r]
                dirty[r] = (int(e[0]), int(e[-1])) if old is None else (min(old[0], int(e[0])), max(old[1], int(e[-1])))
    if cost[0, n - 1] >= _INF:
        return None
    starts = []
    r, e = 0, n - 1
    while True:
        s = int(choice[r, e])
        starts.append(s)
        if s == 0:
            break
        r, e = (r - 1) % dp, s - 1
    return np.array(starts[::-1], dtype=np.int64)


def evolve(index: LcpIndex, capacity: int, starts0: np.ndarray, ks: list[int]) -> dict[int, np.ndarray]:
    """HARTS sampled-K evolution of the natural partition: for K < K0 repeatedly merge the capacity-feasible adjacent
    pair with the largest saving (the LCP at their boundary; ties: lighter union); for K > K0 repeatedly apply the
    split with the smallest increase (`best_split`). A K whose evolution runs out of legal operations is absent."""
    k0 = starts0.size
    found = {k0: starts0.copy()} if k0 in ks else {}
    targets = sorted((k for k in ks if k < k0), reverse=True)
    if targets:
        found.update(_merge_down(index, capacity, starts0, targets))
    targets = sorted(k for k in ks if k > k0)
    if targets:
        found.update(_split_up(index, starts0, targets))
    return found


def _merge_down(index: LcpIndex, capacity: int, starts0: np.ndarray, targets: list[int]) -> dict[int, np.ndarray]:
    n = index.size
    starts = starts0.tolist()
    nxt = {s: (starts[i + 1] if i + 1 < len(starts) else n) for i, s in enumerate(starts)}
    prv = {s: (starts[i - 1] if i > 0 else -1) for i, s in enumerate(starts)}
    heap = []

    def push(a: int) -> None:
        b = nxt[a]
        if b < n:
            union = index.interval_work(a, nxt[b] - 1)
            if union <= capacity:
                heapq.heappush(heap, (-int(index.lcp[b]), union, a, b, nxt[b]))

    def stale(entry: tuple) -> bool:
        _, _, a, b, c = entry
        return nxt.get(a) != b or nxt.get(b) != c

    for s in starts[:-1]:
        push(s)
    found = {}
    k = len(starts)
    for target in targets:
        while k > target:
            while heap and stale(heap[0]):
                heapq.heappop(heap)
            if not heap:
                return found
            _, _, a, b, _ = heapq.heappop(heap)
            nxt[a] = nxt.pop(b)
            del prv[b]
            if nxt[a] < n:
                prv[nxt[a]] = a
            k -= 1
            push(a)
            if prv[a] >= 0:
                push(prv[a])
        found[target] = np.array(sorted(nxt), dtype=np.int64)
    return found


def _split_up(index: LcpIndex, starts0: np.ndarray, targets: list[int]) -> dict[int, np.ndarray]:
    n = index.size
    ends = np.append(starts0[1:], n) - 1
    heap = []

    def push(a: int, b: int) -> None:
        if b > a:
            valley, larger, diff, t = best_split(index, a, b)
            heapq.heappush(heap, (valley, larger, diff, a, b, t))

    for a, b in zip(starts0.tolist(), ends.tolist()):
        push(a, b)
    starts = set(starts0.tolist())
    found = {}
    for target in targets:
        while len(starts) < target:
            if not heap:
                return found
            _, _, _, a, b, t = heapq.heappop(heap)
            starts.add(t)
            push(a, t - 1)
            push(t, b)
        found[target] = np.array(sorted(starts), dtype=np.int64)
    return found
