"""Local refinement of a microbatch grouping (HARTS §3.2 "adaptive candidate refinement", plus elimination).

Legend: N trajectories at lexicographic ranks 0..N-1 (planner/lcp_index.py), K microbatches, T capacity, H window.
A grouping is `owner` [N] int64 (the microbatch of each rank) and `work` [K] int64 (compact work, HARTS eq. 5). The
work a trajectory x adds to a microbatch is |x| minus the longest prefix it shares with a member, and that member is
x's nearest member of the microbatch on one side in lexicographic order (HARTS eq. 10), so every delta below is a few
range-minimum queries.
"""

from __future__ import annotations

import numpy as np

from planner.lcp_index import LcpIndex

__all__ = ["Grouping", "shared_prefix", "refine_boundaries", "sparse_repair", "eliminate_small", "align_k"]


class Grouping:
    """Mutable microbatch membership over lexicographic ranks.

    Attributes:
        owner: [N] int64, microbatch of each rank (0..K-1).
        work: [K] int64, compact work of each microbatch.
    """

    def __init__(self, index: LcpIndex, owner: np.ndarray):
        self.index = index
        self.owner = np.asarray(owner, dtype=np.int64).copy()
        k = int(self.owner.max()) + 1
        self.work = np.array([index.set_work(r) for r in self.groups(k)], dtype=np.int64)

    @classmethod
    def from_starts(cls, index: LcpIndex, starts: np.ndarray) -> "Grouping":
        owner = np.zeros(index.size, dtype=np.int64)
        owner[starts[1:]] = 1
        return cls(index, np.cumsum(owner))

    @property
    def k(self) -> int:
        return int(self.work.size)

    @property
    def total(self) -> int:
        return int(self.work.sum())

    def copy(self) -> "Grouping":
        new = Grouping.__new__(Grouping)
        new.index, new.owner, new.work = self.index, self.owner.copy(), self.work.copy()
        return new

    def groups(self, k: int | None = None) -> list[np.ndarray]:
        """Sorted ranks of every microbatch."""
        k = self.k if k is None else k
        order = np.argsort(self.owner, kind="stable")
        bounds = np.searchsorted(self.owner[order], np.arange(k + 1))
        return [order[bounds[g] : bounds[g + 1]] for g in range(k)]

    def neighbours(self) -> tuple[np.ndarray, np.ndarray]:
        """prev_same, next_same [N]: the previous / next rank of the same microbatch, -1 if none."""
        n = self.owner.size
        order = np.lexsort((np.arange(n), self.owner))
        same = self.owner[order[1:]] == self.owner[order[:-1]]
        prev_same = np.full(n, -1, dtype=np.int64)
        next_same = np.full(n, -1, dtype=np.int64)
        prev_same[order[1:][same]] = order[:-1][same]
        next_same[order[:-1][same]] = order[1:][same]
        return prev_same, next_same

    def rank_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """lo_rank, hi_rank [K]: the smallest and largest assigned rank of each microbatch (N / -1 if none)."""
        n = self.owner.size
        lo_rank = np.full(self.k, n, dtype=np.int64)
        hi_rank = np.full(self.k, -1, dtype=np.int64)
        keep = self.owner >= 0
        ranks = np.flatnonzero(keep)
        np.minimum.at(lo_rank, self.owner[keep], ranks)
        np.maximum.at(hi_rank, self.owner[keep], ranks)
        return lo_rank, hi_rank

    def drop(self, g: int) -> None:
        """Remove the empty microbatch g, renumbering the last one to g."""
        last = self.k - 1
        assert not (self.owner == g).any()
        self.owner[self.owner == last] = g
        self.work[g] = self.work[last]
        self.work = self.work[:last]


def shared_prefix(index: LcpIndex, owner: np.ndarray, lo_rank: np.ndarray, hi_rank: np.ndarray, r: int) -> np.ndarray:
    """[K] the longest prefix rank r shares with a member of each microbatch (owner -1 = unassigned; lo_rank/hi_rank
    bound each microbatch's assigned ranks). Only ranks between r's last lowest LCP valleys on either side are read:
    beyond them every rank shares the same floor with r (LcpIndex.floor_windows)."""
    lcp = index.lcp
    stop_l, floor_l, stop_r, floor_r = index.floor_windows()
    p, q = stop_l[r], stop_r[r]
    shared = np.where(lo_rank < p, floor_l[r], 0)
    np.maximum(shared, np.where(hi_rank >= q, floor_r[r], 0), out=shared)
    if p < r:
        own = owner[p:r]
        keep = own >= 0
        if keep.any():
            left = np.minimum.accumulate(lcp[r:p:-1])[::-1]  # LCP(rank j, rank r) for j in [p, r)
            np.maximum.at(shared, own[keep], left[keep])
    if r + 1 < q:
        own = owner[r + 1 : q]
        keep = own >= 0
        if keep.any():
            right = np.minimum.accumulate(lcp[r + 1 : q])  # LCP(rank r, rank j) for j in (r, q)
            np.maximum.at(shared, own[keep], right[keep])
    return shared


def _pair_lcp(index: LcpIndex, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """LCP of ranks a and b, 0 where either is -1."""
    out = np.zeros(a.size, dtype=np.int64)
    ok = (a >= 0) & (b >= 0)
    if ok.any():
        out[ok] = index.pair_lcp(a[ok], b[ok])
    return out


def refine_boundaries(index: LcpIndex, capacity: int, starts: np.ndarray, window: int = 8,
                      sweeps: int = 2) -> np.ndarray:
    """HARTS boundary refinement of a contiguous partition: move each cut within `window` positions to first reduce the
    two neighbours' total work (the LCP at the cut), then their larger work; at most `sweeps` sweeps, stopping early
    after a sweep without change. Returns new starts (K unchanged, every interval nonempty and within capacity)."""
    starts = starts.copy()
    n = index.size
    for _ in range(sweeps):
        changed = False
        for j in range(1, starts.size):
            a = starts[j - 1]
            b = (starts[j + 1] if j + 1 < starts.size else n) - 1
            t = np.arange(max(a + 1, starts[j] - window), min(b, starts[j] + window) + 1, dtype=np.int64)
            left = index.interval_work(np.full_like(t, a), t - 1)
            right = index.interval_work(t, np.full_like(t, b))
            fits = (left <= capacity) & (right <= capacity)
            t, larger = t[fits], np.maximum(left, right)[fits]
            best = np.lexsort((larger, index.lcp[t]))[0]
            cur = np.flatnonzero(t == starts[j])[0]
            if (index.lcp[t[best]], larger[best]) < (index.lcp[t[cur]], larger[cur]):
                starts[j] = t[best]
                changed = True
        if not changed:
            break
    return starts


def _move_candidates(g: Grouping, window: int):
    """Every (rank r, other microbatch m with a member within `window` ranks of r): the exact work r adds to m.
    Returns (r, m, insert_cost) [M] arrays and remove_gain [N] (the work r's own microbatch loses without it)."""
    index, owner = g.index, g.owner
    n = owner.size
    prev_same, next_same = g.neighbours()
    lengths = index.lengths
    ranks = np.arange(n, dtype=np.int64)
    remove_gain = lengths - np.maximum(_pair_lcp(index, prev_same, ranks), _pair_lcp(index, ranks, next_same))
    rs, ms, lefts, rights = [], [], [], []
    for d in range(1, window + 1):
        r = ranks[d:]
        j = r - d  # a member of owner[j] left of r; the nearest one iff its next same-owner rank lies beyond r
        ok = (owner[j] != owner[r]) & ((next_same[j] < 0) | (next_same[j] > r))
        rs.append(r[ok]), ms.append(owner[j][ok]), lefts.append(j[ok]), rights.append(next_same[j][ok])
        r = ranks[:-d]
        j = r + d  # the nearest member right of r iff its previous same-owner rank lies before r
        ok = (owner[j] != owner[r]) & (prev_same[j] < r)
        rs.append(r[ok]), ms.append(owner[j][ok]), lefts.append(prev_same[j][ok]), rights.append(j[ok])
    r, m = np.concatenate(rs), np.concatenate(ms)
    left, right = np.concatenate(lefts), np.concatenate(rights)
    cost = lengths[r] - np.maximum(_pair_lcp(index, left, r), _pair_lcp(index, r, right))
    return r, m, cost, remove_gain


def _best_move(g: Grouping, capacity: int, window: int) -> tuple[int, int, int] | None:
    r, m, cost, remove_gain = _move_candidates(g, window)
    size = np.bincount(g.owner, minlength=g.k)
    gain = remove_gain[r] - cost
    ok = (size[g.owner[r]] >= 2) & (g.work[m] + cost <= capacity) & (gain > 0)
    if not ok.any():
        return None
    i = np.flatnonzero(ok)[np.argmax(gain[ok])]
    return int(r[i]), int(m[i]), int(gain[i])


def _best_swap(g: Grouping, capacity: int, window: int, checks: int = 32) -> tuple[int, int, np.ndarray] | None:
    """The best strictly improving swap of two ranks at most `window` apart. Candidates are ranked by the sum of the
    four separate deltas (exact unless one of the two is the other's neighbour in its new microbatch), then checked
    exactly. Returns (r, j, new works of their two microbatches) or None."""
    index, owner = g.index, g.owner
    r, m, cost, remove_gain = _move_candidates(g, window)
    k = g.k
    key = r * k + m
    order = np.argsort(key)
    key, cost = key[order], cost[order]
    a = np.repeat(np.arange(index.size, dtype=np.int64), window)
    b = a + np.tile(np.arange(1, window + 1, dtype=np.int64), index.size)
    keep = b < index.size
    a, b = a[keep], b[keep]
    keep = owner[a] != owner[b]
    a, b = a[keep], b[keep]
    if a.size == 0:
        return None
    ia = np.searchsorted(key, a * k + owner[b])  # a into b's microbatch: always present (b is within the window)
    ib = np.searchsorted(key, b * k + owner[a])
    estimate = remove_gain[a] + remove_gain[b] - cost[ia] - cost[ib]
    top = np.argsort(-estimate)[:checks]
    members = g.groups()
    for i in top:
        if estimate[i] <= 0:
            break
        x, y = int(a[i]), int(b[i])
        gx, gy = int(owner[x]), int(owner[y])
        new_x = index.set_work(np.append(members[gx][members[gx] != x], y))
        new_y = index.set_work(np.append(members[gy][members[gy] != y], x))
        if new_x <= capacity and new_y <= capacity and new_x + new_y < g.work[gx] + g.work[gy]:
            return x, y, np.array([new_x, new_y])
    return None


def sparse_repair(g: Grouping, capacity: int, window: int = 8, iterations: int = 4) -> Grouping:
    """HARTS sparse repair: per iteration apply the single best strictly improving move of one trajectory (from a
    microbatch of >= 2 members into one holding a trajectory within `window` lexicographic positions), or if there is
    none the best strictly improving swap of two trajectories within `window` positions. K, coverage, nonemptiness
    and capacity are preserved. Returns a new grouping."""
    g = g.copy()
    for _ in range(iterations):
        move = _best_move(g, capacity, window)
        if move is not None:
            r, m, gain = move
            src = int(g.owner[r])
            members = np.flatnonzero(g.owner == src)
            g.work[src] = g.index.set_work(members[members != r])
            g.owner[r] = m
            g.work[m] = g.index.set_work(np.flatnonzero(g.owner == m))
            continue
        swap = _best_swap(g, capacity, window)
        if swap is None:
            break
        x, y, works = swap
        gx, gy = g.owner[x], g.owner[y]
        g.owner[x], g.owner[y] = gy, gx
        g.work[gx], g.work[gy] = works
    return g


def _place_piece(g: Grouping, piece: np.ndarray, capacity: int, banned: int, lo_rank: np.ndarray,
                 hi_rank: np.ndarray) -> int | None:
    """Insert the unassigned sorted ranks `piece` together into the feasible microbatch that shares the longest prefix
    with its ends (ties: the fullest after insertion). Returns the added work, None if no microbatch takes all of it.
    The longest prefix a microbatch shares with the piece is the longer of its ends' (LCP is a range minimum), unless
    it has members inside the piece's rank range; only then is the union recounted."""
    index = g.index
    first, last = int(piece[0]), int(piece[-1])
    shared = shared_prefix(index, g.owner, lo_rank, hi_rank, first)
    if last != first:
        np.maximum(shared, shared_prefix(index, g.owner, lo_rank, hi_rank, last), out=shared)
    after = g.work + index.sorted_work(piece) - shared
    fits = after <= capacity
    fits[banned] = False
    if not fits.any():
        return None
    cand = np.flatnonzero(fits)
    dest = int(cand[np.lexsort((-after[cand], -shared[cand]))[0]])
    work = int(after[dest])
    if lo_rank[dest] < last and hi_rank[dest] > first:
        work = index.set_work(np.concatenate([np.flatnonzero(g.owner == dest), piece]))
        if work > capacity:
            return None
    added = work - int(g.work[dest])
    g.owner[piece] = dest
    g.work[dest] = work
    lo_rank[dest] = min(lo_rank[dest], first)
    hi_rank[dest] = max(hi_rank[dest], last)
    return added


def _place_all(g: Grouping, ranks: np.ndarray, capacity: int, banned: int) -> int | None:
    """Insert the unassigned sorted `ranks` into other microbatches, never into `banned`: each run of them that shares
    more than the common floor goes whole where it shares most and fits, else trajectory by trajectory. Updates g;
    returns the total added work, None if a trajectory fits nowhere."""
    index = g.index
    floor = int(index.lcp[1:].min()) if index.size > 1 else 0
    lo_rank, hi_rank = g.rank_bounds()
    cuts = np.flatnonzero(index.pair_lcp(ranks[:-1], ranks[1:]) <= floor) + 1 if ranks.size > 1 else []
    added = 0
    for piece in np.split(ranks, cuts):
        whole = _place_piece(g, piece, capacity, banned, lo_rank, hi_rank)
        if whole is not None:
            added += whole
            continue
        for r in piece.tolist():
            one = _place_piece(g, np.array([r]), capacity, banned, lo_rank, hi_rank)
            if one is None:
                return None
            added += one
    return added


def _dissolve_one(g: Grouping, capacity: int, max_increase: int, tries: int) -> Grouping | None:
    """Dissolve the lightest microbatch whose members all fit elsewhere (`_place_all`) adding at most `max_increase`
    work; at most `tries` microbatches are tried, and none heavier than the others' free room. Returns a new grouping
    with K - 1 microbatches, or None."""
    free = capacity * g.k - g.total
    for victim in np.argsort(g.work, kind="stable")[:tries].tolist():
        if g.work[victim] > free - (capacity - g.work[victim]):
            return None
        trial = g.copy()
        members = np.flatnonzero(trial.owner == victim)
        trial.owner[members] = -1
        added = _place_all(trial, members, capacity, victim)
        if added is not None and added - g.work[victim] <= max_increase:
            trial.work[victim] = 0
            trial.drop(victim)
            return trial
    return None


def eliminate_small(g: Grouping, capacity: int, dp: int, tries: int = 32) -> list[Grouping]:
    """Dissolve light microbatches into the others while that adds no work (`_dissolve_one`). Returns the groupings
    met whose K is a multiple of `dp` (the input's first if it is one, least K last). If the last K met is not a
    multiple of `dp`, it is also aligned the cheaper way, by cuts (`align_k`) or by dissolving more microbatches at a
    smaller work increase, and that grouping is appended when it has less work than the last aligned one."""
    aligned = [g.copy()] if g.k % dp == 0 else []
    while g.k > dp:
        smaller = _dissolve_one(g, capacity, 0, tries)
        if smaller is None:
            break
        g = smaller
        if g.k % dp == 0:
            aligned.append(g.copy())
    if g.k % dp:
        best = align_k(g, dp)
        down = g
        budget = np.iinfo(np.int64).max if best is None else best.total - g.total - 1
        while down is not None and down.k % dp and budget >= 0 and down.k > dp:
            before = down.total
            down = _dissolve_one(down, capacity, budget, tries)
            if down is not None:
                budget -= down.total - before
        if down is not None and down.k % dp == 0 and budget >= 0:
            best = down
        if best is not None and (not aligned or best.total < aligned[-1].total):
            aligned.append(best)
    return aligned


def align_k(g: Grouping, dp: int) -> Grouping | None:
    """Make K a multiple of `dp` by splits: repeatedly cut the microbatch whose member list (in lexicographic order)
    has the cheapest cut (the LCP of the two members it separates, HARTS eq. 6), ties to the cut whose lighter half is
    heaviest. HARTS splits off single trajectories; a cut next to a trajectory never costs more than splitting it
    off, and the tie-break halves a heavy microbatch instead of leaving a tiny one behind. Returns a new grouping, or
    None when every microbatch is a single trajectory."""
    g = g.copy()
    index = g.index
    n = index.size
    while g.k % dp:
        order = np.lexsort((np.arange(n), g.owner))
        owner = g.owner[order]
        same = owner[1:] == owner[:-1]
        if not same.any():
            return None
        shared = np.zeros(n - 1, dtype=np.int64)
        shared[same] = index.pair_lcp(order[:-1][same], order[1:][same])
        added = index.lengths[order].copy()
        added[1:] -= shared  # work each member adds to the members before it (its full length if it comes first)
        total = np.cumsum(added)
        group_start = np.maximum.accumulate(np.where(np.append(True, ~same), np.arange(n), 0))
        before = np.where(group_start > 0, total[group_start - 1], 0)
        left = (total - before)[:-1]  # work of the members up to i, cutting between i and i + 1
        right = g.work[owner[:-1]] - left + shared
        cand = np.flatnonzero(same)
        i = int(cand[np.lexsort((-np.minimum(left, right)[cand], shared[cand]))[0]])
        src = int(owner[i])
        moved = order[i + 1 :][owner[i + 1 :] == src]
        g.owner[moved] = g.k
        g.work[src] = left[i]
        g.work = np.append(g.work, right[i])
    return g
