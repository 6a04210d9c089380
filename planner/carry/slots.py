"""The microbatches of one DP replica in carry mode: which rows of which unit each slot runs.

Legend: J slots, T capacity, R_u rows of unit u, c = ceil(sum_u R_u / J) <= T the rows of one microbatch.

A microbatch holds parts (contiguous preorder row ranges) of units. Whatever a part reads of its unit's earlier parts
keeps those microbatches alive (forwarded, not yet backwarded) until it is backwarded itself, and a microbatch that
holds parts of two units keeps both units' earlier parts alive. So a unit with R_u >= c is laid out as a *head*, its
first h_u = R_u mod c rows, followed by a *run*: k_u = floor(R_u / c) microbatches of exactly c rows that hold
nothing else. Heads and the units smaller than c are concatenated into *mixed* microbatches of about c rows; after
each mixed microbatch come the runs of the units whose heads it completed. A mixed microbatch then stays alive only
while the runs that follow it execute (plus, when it shares a cut head with the next mixed microbatch, until that
one closes). Every run microbatch holds exactly c rows, every mixed one between (1 - underfill) c and T.

Filling a mixed microbatch: first the rest of a head cut by the previous one; then, if a set of whole items fills
it to between (1 - underfill) c (as far as spare rows allow) and T rows, that set (subset sum; nothing is cut, so
the next mixed microbatch does not read this one); otherwise the largest items that fit whole, and the remaining
room is filled by cutting one splittable item, the one whose cut splits the shortest path (`UnitRows.mid_path`: a
cut right after a leaf splits none; otherwise the rows above the cut are gathered again by the row after it). Such
a cut makes the next mixed microbatch read this one, which then stays open until the runs after that one are done.
Items marked whole (the duplicated trees of the auto mode, each at most T rows) are never cut; when only whole items
that do not fit remain, the microbatch stays short (an empty one takes the smallest whole item).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from planner.carry.rows import UnitRows

__all__ = ["Piece", "layout_replica"]


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of unit `unit` (an index into the replica's unit list)."""

    unit: int
    start: int
    stop: int


def _cut_cost(rows: UnitRows, cut: int) -> int:
    """Rows gathered again when a part ends before row `cut` of its unit: the path above it, 0 after a leaf."""
    if cut <= 0 or cut >= rows.num_rows:
        return 0
    return int(rows.positions(cut)) if bool(rows.mid_path(cut)) else 0


def subset_with_sum(sizes: list[int], lo: int, hi: int, target: int) -> list[int] | None:
    """Indices of a subset of `sizes` (each >= 1) whose sum lies in [lo, hi], the sum closest to `target`; None when
    there is none. Dynamic programme over reachable sums (O(len(sizes) * hi) bits)."""
    if lo > hi or hi < 0:
        return None
    reach = [np.zeros(hi + 1, dtype=bool)]
    reach[0][0] = True
    for size in sizes:
        r = reach[-1].copy()
        if size <= hi:
            r[size:] |= reach[-1][: hi + 1 - size]
        reach.append(r)
    sums = np.flatnonzero(reach[-1][max(lo, 0):]) + max(lo, 0)
    if sums.size == 0:
        return None
    total = int(sums[np.argmin(np.abs(sums - target))])
    chosen = []
    for i in range(len(sizes), 0, -1):
        if not reach[i - 1][total]:
            chosen.append(i - 1)
            total -= sizes[i - 1]
    return chosen[::-1]


def layout_replica(units: list[UnitRows], whole: list[bool], slots: int, capacity: int,
                   underfill: float = 0.01) -> list[list[Piece]]:
    """The microbatches (one list of pieces per slot, in slot order) of one replica's units.

    Args:
        units: the replica's units; whole: [U] never cut these (each must fit in one microbatch).
        slots: J, the number of slots every replica gets (c = ceil(total rows / J)).
        capacity: T; a mixed microbatch holds at most T rows.
        underfill: a mixed microbatch may hold down to (1 - underfill) c rows, as far as the slots' spare rows
            (J c - total, plus what fuller mixed microbatches left) allow, when that avoids cutting an item.
    Returns at most J microbatches when no unit is whole; with whole units there may be more (the caller then
    raises J).
    """
    total = sum(u.num_rows for u in units)
    if total == 0:
        return []
    c = -(-total // slots)
    run_length, head = {}, {}
    items: list[int] = []
    ready = deque()
    for u, rows in enumerate(units):
        size = rows.num_rows
        if whole[u] or size < c:
            head[u] = size
            items.append(u)
            continue
        run_length[u], head[u] = divmod(size, c)
        if head[u]:
            items.append(u)
        else:
            ready.append(u)
    placed = {u: 0 for u in items}
    run_done = {u: 0 for u in run_length}
    items.sort(key=lambda u: -head[u])
    spare = slots * c - total
    cut_item: int | None = None
    out: list[list[Piece]] = []
    while ready or items or cut_item is not None:
        if ready:
            u = ready[0]
            start = head[u] + run_done[u] * c
            out.append([Piece(u, start, start + c)])
            run_done[u] += 1
            if run_done[u] == run_length[u]:
                ready.popleft()
            continue
        room, chunk, completed = c, [], []

        def put(u: int, rows: int) -> None:
            nonlocal room
            chunk.append(Piece(u, placed[u], placed[u] + rows))
            placed[u] += rows
            room -= rows
            if placed[u] == head[u]:
                completed.append(u)

        if cut_item is not None:
            u, cut_item = cut_item, None
            rest = head[u] - placed[u]
            if rest > room:
                cut_item = u
            put(u, min(rest, room))
        chosen = None
        if cut_item is None and items:
            sizes = [head[u] for u in items]
            short = min(int(underfill * c), max(spare, 0))
            chosen = subset_with_sum(sizes, room - short, room + capacity - c, room)
            if chosen is not None:
                for u in [items[i] for i in chosen]:
                    items.remove(u)
                    put(u, head[u])
        while room > 0 and items and cut_item is None and chosen is None:
            fitting = [u for u in items if head[u] <= room]
            if fitting:
                u = fitting[0]
                items.remove(u)
                put(u, head[u])
                continue
            splittable = [u for u in items if not whole[u]]
            if not splittable:
                if not chunk:
                    u = min(items, key=lambda v: head[v])
                    items.remove(u)
                    put(u, head[u])
                break
            u = min(splittable, key=lambda v: (_cut_cost(units[v], placed[v] + room), -head[v]))
            items.remove(u)
            cut_item = u
            put(u, room)
        spare -= c - sum(p.stop - p.start for p in chunk)
        out.append(chunk)
        ready.extend(u for u in completed if u in run_length)
    return out
