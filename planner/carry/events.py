"""What the parts of a carry plan read from each other, and the forward/backward events every replica runs.

Legend: D replicas, J slots, M microbatches of one replica (one per slot it uses).

A part [a, b) of a unit reads its context, the root path of row a without a itself (`UnitRows.ancestor_ranges`): in
preorder every ancestor of a row of the part that lies outside the part is an ancestor of a. Microbatch m *reads*
microbatch m' < m of its replica when one of its parts reads rows of a part in m'; m' then exports those rows to m
and injects the gradients m sends back, so m' is backwarded after m.

Events: every replica forwards its microbatches in slot order. As soon as possible (ASAP) a replica backwards each
microbatch once every microbatch that reads it has been backwarded; that keeps the fewest microbatches open
(forwarded, not yet backwarded) at every point, P_d at most on replica d. The replicas then run one shared sequence
of event kinds, so that FSDP2/TP/EP collectives line up: forward event j is slot j on every replica, and after it
come as many backward events as the replica furthest behind needs to have at most max_d P_d - 1 microbatches open
before the next forward (all that remain after the last); in each backward event a replica backwards its latest
ready microbatch, or runs an empty event (slot -1) when it has none ready.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.carry.rows import UnitRows

__all__ = ["PartReads", "part_reads", "asap_peak", "shared_events"]


@dataclass(frozen=True)
class PartReads:
    """What one replica's microbatches read of each other.

    reads: [M] the slots each microbatch reads (ascending). exported_rows: [M] rows of each microbatch read by later
    ones (their union, counted once). context_rows: per microbatch, the context rows of each of its parts (in piece
    order).
    """

    reads: list[tuple[int, ...]]
    exported_rows: list[int]
    context_rows: list[list[int]]


def _union_length(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, stop in sorted(intervals):
        if reach is None or start > reach:
            total += stop - start
            reach = stop
        elif stop > reach:
            total += stop - reach
            reach = stop
    return total


def part_reads(units: list[UnitRows], microbatches: list[list]) -> PartReads:
    """Reads of one replica's microbatches; `microbatches[m]` holds pieces with `unit`, `start`, `stop`."""
    by_unit: dict[int, list[tuple[int, int, int]]] = {}
    for m, pieces in enumerate(microbatches):
        for p in pieces:
            by_unit.setdefault(p.unit, []).append((p.start, p.stop, m))
    reads = [set() for _ in microbatches]
    exported: list[dict[int, list[tuple[int, int]]]] = [{} for _ in microbatches]
    context = [[0] * len(pieces) for pieces in microbatches]
    for u, parts in by_unit.items():
        parts.sort()
        starts = np.array([s for s, _, _ in parts], dtype=np.int64)
        rows = units[u]
        for start, _, m in parts:
            for x, y in rows.ancestor_ranges(start):
                first = int(np.searchsorted(starts, x, side="right")) - 1
                last = int(np.searchsorted(starts, y - 1, side="right")) - 1
                for i in range(first, last + 1):
                    p_start, p_stop, producer = parts[i]
                    reads[m].add(producer)
                    exported[producer].setdefault(u, []).append((max(x, p_start), min(y, p_stop)))
    for m, pieces in enumerate(microbatches):
        for i, p in enumerate(pieces):
            context[m][i] = int(units[p.unit].positions(p.start))
    return PartReads([tuple(sorted(r)) for r in reads],
                     [sum(_union_length(e) for e in per_unit.values()) for per_unit in exported], context)


def _readers(reads: list[tuple[int, ...]]) -> list[list[int]]:
    readers = [[] for _ in reads]
    for m, rs in enumerate(reads):
        for r in rs:
            readers[r].append(m)
    return readers


def _latest_ready(open_: set[int], done: set[int], readers: list[list[int]]) -> int | None:
    for m in sorted(open_, reverse=True):
        if all(r in done for r in readers[m]):
            return m
    return None


def asap_peak(reads: list[tuple[int, ...]]) -> int:
    """P_d: the most microbatches open at once when each is backwarded as soon as its readers are."""
    readers = _readers(reads)
    open_, done, peak = set(), set(), 0
    for j in range(len(reads)):
        open_.add(j)
        peak = max(peak, len(open_))
        while (m := _latest_ready(open_, done, readers)) is not None:
            open_.remove(m)
            done.add(m)
    return peak


def shared_events(reads_per_replica: list[list[tuple[int, ...]]], slots: int
                  ) -> tuple[tuple[tuple[tuple[str, int], ...], ...], int]:
    """The event sequence of every replica (see the module docstring) and the most microbatches open at once on any
    replica under it. `reads_per_replica[d][m]`: slots microbatch m of replica d reads; replica d uses slots
    0 .. len(reads_per_replica[d]) - 1 of `slots`."""
    limit = max([asap_peak(r) for r in reads_per_replica] + [1])
    readers = [_readers(r) for r in reads_per_replica]
    opened = [set() for _ in reads_per_replica]
    done = [set() for _ in reads_per_replica]
    events = [[] for _ in reads_per_replica]
    peak = 0
    for j in range(slots):
        for d, reads in enumerate(reads_per_replica):
            if j < len(reads):
                opened[d].add(j)
                events[d].append(("forward", j))
            else:
                events[d].append(("forward", -1))
        peak = max(peak, max(len(o) for o in opened))
        keep = 0 if j == slots - 1 else limit - 1
        for _ in range(max(len(o) - keep for o in opened)):
            for d in range(len(reads_per_replica)):
                m = _latest_ready(opened[d], done[d], readers[d])
                if m is None:
                    events[d].append(("backward", -1))
                else:
                    opened[d].remove(m)
                    done[d].add(m)
                    events[d].append(("backward", m))
    return tuple(tuple(e) for e in events), peak
