"""Prefix carry across microbatches: every unique row executed once, also when a tree exceeds capacity.

Legend: N trajectories, T capacity (compact rows per microbatch), D DP replicas (`dp`), J slots, U trees (units).

    plan = plan_carry(trajectories, capacity=65_536, dp=4)
    for mb in plan.microbatches: mb.parts (tree, start, stop), mb.replica, mb.slot, mb.compact_tokens, mb.reads
    plan.events[d]: replica d's ("forward" | "backward", slot) events, slot -1 for an empty one
    plan.replica(d): replica d's share, as a HARTS plan gives it too (planner/replica_share.py)

Trees. `plan.trees[u]` are the trajectory indices of tree u; its rows are those of `planner.pack.pack` of these
trajectories, in pack's preorder (tree-local ids 0 .. R_u - 1). A tree is a rank range of pack's order
(`planner.lcp_index.lexicographic_lcp(..., byteorder=">")`), so its rows follow from that order and the adjacent LCPs
(planner/carry/rows.py) without building a trie. The trees are the trie's connected components, split where two
trajectories share only a few rows (for SWE-like steps: the 3-token chat-template start every rollout tree hangs
from), which are then executed once per tree (planner/carry/balance.py). Executed rows = the step's trie rows plus
those shared prefixes. In auto mode (planner/step_plan.py) a tree may also be a group of whole trajectories of at
most T rows that is never cut (one part): a duplicated tree.

Parts. A part is a contiguous preorder row range [start, stop) of one tree, cut anywhere (also inside one path, so a
trajectory longer than T plans). Its context, what it reads of its tree's earlier parts, is the root path of row
`start` without the row itself: `context_rows` = the position of that row. All parts of a tree run on one replica,
in increasing slots (planner/carry/slots.py says how the rows of a replica are laid out so that few microbatches
stay open); every replica runs the same sequence of event kinds (planner/carry/events.py).

Guarantees (tests/planner/test_carry.py): the parts of every tree cover its rows exactly once; every microbatch holds
at most T rows; a microbatch only reads microbatches of its replica in earlier slots and is backwarded after every
microbatch that reads it; the events of all replicas have the same kinds in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from planner.carry.balance import Unit, balance_units
from planner.carry.events import part_reads, shared_events
from planner.carry.rows import UnitRows
from planner.carry.slots import layout_replica
from planner.lcp_index import lexicographic_lcp
from planner.microbatch.plan import check_inputs, imbalance, objective, slot_work
from planner.replica_share import ReplicaShare, check_replica
from planner.trajectory import Trajectory

__all__ = ["CarryPart", "CarryMicrobatch", "CarryPlan", "ContextSizes", "ContextBound", "SortedStep", "plan_carry",
           "plan_units"]


@dataclass(frozen=True)
class CarryPart:
    """Rows [start, stop) of tree `tree` (an index into CarryPlan.trees), in pack's preorder of that tree.

    context_rows: rows of earlier parts it reads (the root path of `start` without it; its position).
    entries: positions of its rows whose parent is a context row (where a linear-attention sequence continues a
    path of earlier parts: it starts from the state at the anchor floor(p / B) * B and replays [anchor, p)).
    """

    tree: int
    start: int
    stop: int
    context_rows: int = 0
    entries: tuple[int, ...] = ()


@dataclass(frozen=True)
class CarryMicrobatch:
    """The parts one replica runs in one slot. compact_tokens = the sum of part sizes.

    reads: slots (of the same replica) of the microbatches whose rows its parts read.
    exported_rows: its rows that later microbatches read (counted once).
    """

    parts: tuple[CarryPart, ...]
    replica: int
    slot: int
    compact_tokens: int
    reads: tuple[int, ...] = ()
    exported_rows: int = 0


@dataclass(frozen=True)
class ContextSizes:
    """A model's bytes per carried item, each summed over the layers of its kind (see `CarryPlan.context_bound`).

    full_attention_row: keys + values of one row (for MLA whichever form the execution carries).
    linear_state: one linear-attention state ([HV, K, V] fp32 per layer).
    linear_row: the core inputs (q, k, v, gates, beta) of one replayed row.
    conv_row: the short-convolution input of one row.
    chunk_size: B of the linear-attention core; conv_width: W of the short convolution.
    """

    full_attention_row: int
    linear_state: int
    linear_row: int
    conv_row: int
    chunk_size: int
    conv_width: int


@dataclass(frozen=True)
class ContextBound:
    """What carrying costs in memory under a plan's event order.

    max_context_rows: the longest context of a part. part_bytes: per layer kind ("full_attention",
    "linear_attention", "conv"), the most bytes one part reads as carried inputs (linear attention and conv: an upper
    bound, one state and replay per entry). held_full_attention_bytes: the most key/value bytes that open
    microbatches export at once (their gradients accumulate beside them, as many again).
    max_open_microbatches / max_open_rows: microbatches (and their rows) forwarded and not yet backwarded at once,
    the current one included; under full-layer recomputation each keeps its layer inputs.
    """

    max_context_rows: int
    part_bytes: dict[str, int]
    held_full_attention_bytes: int
    max_open_microbatches: int
    max_open_rows: int


@dataclass(frozen=True)
class CarryPlan:
    """Microbatches ordered by (slot, replica); events per replica (see the module docstring)."""

    carries: ClassVar[bool] = True
    """Parts read context from earlier microbatches (`ReplicaShare.carries`)."""

    trees: tuple[tuple[int, ...], ...]
    microbatches: tuple[CarryMicrobatch, ...]
    capacity: int
    dp: int
    events: tuple[tuple[tuple[str, int], ...], ...]
    trie_compact_tokens: int = 0
    """Rows of the step's trie (what executing every unique row once costs)."""
    max_open_microbatches: int = 0
    """The most microbatches one replica has forwarded and not yet backwarded at once under `events`."""
    tree_extra_view_rows: tuple[int, ...] = ()
    """Per tree: rows its part boundaries add to the attention views (a cut inside a path makes the rows above it
    part of one more view; a cut right after a leaf adds none)."""
    planning_seconds: float = 0.0
    method: str = "carry"

    @property
    def total_compact_tokens(self) -> int:
        """Executed rows."""
        return sum(mb.compact_tokens for mb in self.microbatches)

    @property
    def num_slots(self) -> int:
        return 1 + max((mb.slot for mb in self.microbatches), default=-1)

    @property
    def extra_view_rows(self) -> int:
        return sum(self.tree_extra_view_rows)

    @property
    def max_context_rows(self) -> int:
        return max((p.context_rows for mb in self.microbatches for p in mb.parts), default=0)

    @property
    def empty_events(self) -> int:
        return sum(slot < 0 for events in self.events for _, slot in events)

    def _assignment(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(work, replica, slot) [J * D], with zero work where a replica leaves a slot empty."""
        w = np.zeros((self.num_slots, self.dp), dtype=np.int64)
        for mb in self.microbatches:
            w[mb.slot, mb.replica] = mb.compact_tokens
        slot, replica = np.divmod(np.arange(w.size, dtype=np.int64), self.dp)
        return w.ravel(), replica, slot

    def slot_work(self) -> np.ndarray:
        """[J, D] int64: rows of the microbatch replica d runs in slot j (0 for none)."""
        return slot_work(*self._assignment(), self.dp)

    def objective(self) -> tuple[int, int, int, int]:
        """HARTS eq. 4 and then the number of slots (`planner.microbatch.plan.objective`), on executed rows."""
        return objective(*self._assignment(), self.dp)

    def replica(self, dp_rank: int) -> ReplicaShare:
        """Replica `dp_rank`'s share (`planner.replica_share`): the trees its parts name (in tree order), its
        microbatches' parts in slot order and its events, with slots renumbered to its own microbatches."""
        check_replica(dp_rank, self.dp)
        mine = sorted((mb for mb in self.microbatches if mb.replica == dp_rank), key=lambda mb: mb.slot)
        slot_of = {mb.slot: k for k, mb in enumerate(mine)}
        used = sorted({p.tree for mb in mine for p in mb.parts})
        unit_of = {tree: u for u, tree in enumerate(used)}
        return ReplicaShare(
            units=tuple(self.trees[tree] for tree in used),
            parts=tuple(tuple((unit_of[p.tree], p.start, p.stop) for p in mb.parts) for mb in mine),
            events=tuple((kind, slot_of[slot] if slot >= 0 else -1) for kind, slot in self.events[dp_rank]),
            carries=self.carries, flat=(False,) * len(mine))

    def context_bound(self, sizes: ContextSizes) -> ContextBound:
        """The carried context of this plan for a model of the given sizes (see ContextBound)."""
        part_bytes = {"full_attention": 0, "linear_attention": 0, "conv": 0}
        for mb in self.microbatches:
            for p in mb.parts:
                entries = np.asarray(p.entries, dtype=np.int64)
                replay = entries % sizes.chunk_size
                anchors = int((entries - replay > 0).sum())
                conv = np.minimum(entries, sizes.conv_width - 1).sum()
                for kind, value in (("full_attention", p.context_rows * sizes.full_attention_row),
                                    ("linear_attention", anchors * sizes.linear_state
                                     + int(replay.sum()) * sizes.linear_row),
                                    ("conv", int(conv) * sizes.conv_row)):
                    part_bytes[kind] = max(part_bytes[kind], int(value))
        by_slot = {(mb.replica, mb.slot): mb for mb in self.microbatches}
        held = open_count = open_rows = 0
        for d, events in enumerate(self.events):
            alive: set[int] = set()
            for kind, s in events:
                if s < 0:
                    continue
                if kind == "forward":
                    alive.add(s)
                    open_count = max(open_count, len(alive))
                    open_rows = max(open_rows, sum(by_slot[d, m].compact_tokens for m in alive))
                    held = max(held, sum(by_slot[d, m].exported_rows for m in alive))
                else:
                    alive.discard(s)
        return ContextBound(self.max_context_rows, part_bytes, held * sizes.full_attention_row, open_count,
                            open_rows)

    def to_json(self) -> dict:
        per_slot = imbalance(self.slot_work())
        return {
            "microbatches": [
                {"parts": [{"tree": p.tree, "start": p.start, "stop": p.stop, "context_rows": p.context_rows}
                           for p in mb.parts],
                 "replica": mb.replica, "slot": mb.slot, "compact_tokens": mb.compact_tokens, "reads": list(mb.reads)}
                for mb in self.microbatches
            ],
            "trees": [list(t) for t in self.trees],
            "events": [[list(e) for e in events] for events in self.events],
            "total_compact_tokens": self.total_compact_tokens,
            "trie_compact_tokens": self.trie_compact_tokens,
            "max_context_rows": self.max_context_rows,
            "max_open_microbatches": self.max_open_microbatches,
            "extra_view_rows": self.extra_view_rows,
            "empty_events": self.empty_events,
            "slot_imbalance": {"p50": float(np.percentile(per_slot, 50)), "p95": float(np.percentile(per_slot, 95)),
                               "max": float(per_slot.max())},
            "planning_seconds": self.planning_seconds,
        }


@dataclass(frozen=True)
class SortedStep:
    """A step in pack's order: order [N] (trajectory at each rank), lcp [N] (lcp[0] = 0), length [N] at each rank."""

    order: np.ndarray
    lcp: np.ndarray
    length: np.ndarray

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory]) -> "SortedStep":
        order, lcp = lexicographic_lcp([t.tokens for t in trajectories], byteorder=">")
        lengths = np.fromiter((len(t) for t in trajectories), dtype=np.int64, count=len(trajectories))
        return cls(order, lcp, lengths[order])

    @property
    def trie_rows(self) -> int:
        return int((self.length - self.lcp).sum())

    def unit_rows(self, unit: Unit) -> UnitRows:
        return UnitRows(unit.lo, unit.hi, self.lcp[unit.lo : unit.hi], self.length[unit.lo : unit.hi])


def plan_units(step: SortedStep, units: list[Unit], whole: list[bool], capacity: int, dp: int, seconds_from: float,
               method: str) -> CarryPlan:
    """Lay out given units (rank ranges with replicas, in rank order) over the fewest slots that hold them, read
    their dependencies and build the events. `whole[u]`: never cut unit u (it must fit in `capacity`)."""
    rows = [step.unit_rows(u) for u in units]
    mine = [[u for u, unit in enumerate(units) if unit.replica == d] for d in range(dp)]
    totals = [sum(rows[u].num_rows for u in m) for m in mine]
    slots = max(1, -(-max(totals) // capacity))
    while True:
        layouts = [layout_replica([rows[u] for u in m], [whole[u] for u in m], slots, capacity) for m in mine]
        needed = max(len(layout) for layout in layouts)
        if needed <= slots:
            break
        slots = needed
    microbatches, events_reads, extra_view = [], [], [0] * len(units)
    for d, (m, layout) in enumerate(zip(mine, layouts)):
        local = [rows[u] for u in m]
        reads = part_reads(local, layout)
        events_reads.append(reads.reads)
        cuts = [[] for _ in m]
        for chunk in layout:
            for p in chunk:
                if p.start > 0:
                    cuts[p.unit].append(p.start)
        for u, starts in zip(m, cuts):
            if starts:
                starts = np.asarray(starts, dtype=np.int64)
                extra_view[u] = int(np.where(rows[u].mid_path(starts), rows[u].positions(starts), 0).sum())
        for slot, chunk in enumerate(layout):
            parts = tuple(
                CarryPart(m[p.unit], p.start, p.stop, reads.context_rows[slot][i],
                          tuple(int(e) for e in local[p.unit].entry_positions(p.start, p.stop)))
                for i, p in enumerate(chunk))
            microbatches.append(CarryMicrobatch(parts, d, slot, sum(p.stop - p.start for p in chunk),
                                                reads.reads[slot], reads.exported_rows[slot]))
    events, peak = shared_events(events_reads, slots)
    microbatches.sort(key=lambda mb: (mb.slot, mb.replica))
    trees = tuple(tuple(sorted(int(i) for i in step.order[u.lo : u.hi])) for u in units)
    return CarryPlan(trees, tuple(microbatches), capacity, dp, events, step.trie_rows, peak, tuple(extra_view),
                     time.perf_counter() - seconds_from, method)


def plan_carry(trajectories: Sequence[Trajectory], capacity: int, dp: int, *, tolerance: float = 2e-4,
               split_budget: float = 5e-3) -> CarryPlan:
    """Plan a step in carry mode: parts of at most `capacity` rows, every unique row executed once per tree.

    Args:
        trajectories: root-to-leaf paths of any number of trees; a path may be longer than `capacity`.
        capacity: T, rows per microbatch. dp: D replicas (a replica may get no work when there are too few trees).
        tolerance, split_budget: replica balance (planner.carry.balance.balance_units).
    Raises:
        ValueError / TypeError: empty input, or capacity or dp not an int >= 1.
    """
    start = time.perf_counter()
    check_inputs(trajectories, capacity, dp, split_paths=True)
    step = SortedStep.from_trajectories(trajectories)
    units = balance_units(step.lcp, step.length, dp, tolerance=tolerance, split_budget=split_budget)
    return plan_units(step, units, [False] * len(units), capacity, dp, start, "carry")
