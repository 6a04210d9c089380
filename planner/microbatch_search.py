"""Contiguous partitions of the lexicographic order (HARTS §3.2): natural partition, K range, exact DP, K evolution.

Legend: N trajectories, ranks 0..N-1 in lexicographic order (planner/lcp_index.py), K microbatches, T capacity.
A contiguous partition is given by `starts` [K] int64: microbatch i holds ranks starts[i] .. starts[i+1]-1
(starts[0] = 0, the last one ends at N-1). By HARTS eq. 6 its total compact work is G + sum(lcp[starts[1:]]):
every cut duplicates exactly the LCP of the two trajectories it separates.
"""

from __future__ import annotations

import heapq

import numpy as np

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


def _argmin_table(values: np.ndarray) -> list[np.ndarray]:
    """Sparse table of argmins: table[j][i] = argmin(values[i : i + 2**j]) (leftmost on ties)."""
    table = [np.arange(values.size, dtype=np.int64)]
    span = 1
    while 2 * span <= values.size:
        prev = table[-1]
        left, right = prev[:-span], prev[span:]
        table.append(np.where(values[right] < values[left], right, left))
        span *= 2
    return table


def _range_argmin(values: np.ndarray, table: list[np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    j = (np.frexp((hi - lo + 1).astype(np.float64))[1] - 1).astype(np.int64)
    out = np.empty(lo.size, dtype=np.int64)
    for level in np.unique(j):
        sel = j == level
        t = table[int(level)]
        a, b = t[lo[sel]], t[hi[sel] - (1 << int(level)) + 1]
        out[sel] = np.where(values[b] < values[a], b, a)
    return out


def exact_dp(index: LcpIndex, capacity: int, ks: list[int]) -> dict[int, np.ndarray]:
    """Minimum-work contiguous partition into exactly k nonempty capacity-feasible intervals, for every k in ks.

    F[k, e] = min over feasible starts s of F[k-1, s-1] + lcp[s] (HARTS eq. 9 with eq. 6: the work of a partition is G
    plus its cut LCPs). Every layer k is one vectorised range-minimum pass over all end ranks e (a sparse table over
    the candidates' keys), so the whole table costs O(max(ks) N log N) numpy work. Ties on the work prefer the smaller
    heaviest microbatch of the prefix partition (HARTS breaks ties by the heaviest microbatch of the whole partition).
    Returns {k: starts} for the feasible k.
    """
    n = index.size
    k_top = min(max(ks), n)
    ends = np.arange(n, dtype=np.int64)
    lo = window_starts(index, capacity)
    weight = capacity + 1
    cost = np.where(lo == 0, 0, _INF)  # F[1, e]
    heavy = np.where(lo == 0, index.interval_work(np.zeros(n, dtype=np.int64), ends), _INF)
    choice = np.zeros((k_top + 1, n), dtype=np.int32)
    found = {}
    if 1 in ks and cost[-1] < _INF:
        found[1] = np.zeros(1, dtype=np.int64)
    for k in range(2, k_top + 1):
        key = np.full(n, _INF, dtype=np.int64)
        prev_ok = cost[:-1] < _INF
        key[1:][prev_ok] = (cost[:-1][prev_ok] + index.lcp[1:][prev_ok]) * weight + heavy[:-1][prev_ok]
        first = np.maximum(lo, k - 1)
        valid = first <= ends
        s = np.zeros(n, dtype=np.int64)
        s[valid] = _range_argmin(key, _argmin_table(key), first[valid], ends[valid])
        ok = valid & (key[s] < _INF)
        new_cost = np.full(n, _INF, dtype=np.int64)
        new_heavy = np.full(n, _INF, dtype=np.int64)
        new_cost[ok] = cost[s[ok] - 1] + index.lcp[s[ok]]
        new_heavy[ok] = np.maximum(heavy[s[ok] - 1], index.interval_work(s[ok], ends[ok]))
        choice[k] = s
        cost, heavy = new_cost, new_heavy
        if k in ks and cost[-1] < _INF:
            starts = [0] * k
            e = n - 1
            for level in range(k, 1, -1):
                starts[level - 1] = int(choice[level, e])
                e = starts[level - 1] - 1
            found[k] = np.array(starts, dtype=np.int64)
    return found


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
