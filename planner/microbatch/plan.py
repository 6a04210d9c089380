"""Prefix-aware microbatch, DP-replica and slot planner (HARTS §3.2).

Legend: N trajectories, K microbatches, D DP replicas (`dp`), T capacity (unique compact tokens per microbatch),
J = K / D slots. The work of a microbatch is its number of unique compact tokens (trie nodes, HARTS eq. 5).

    plan = plan_microbatches(trajectories, capacity=65_536, dp=4)
    for mb in plan.microbatches: mb.trajectories, mb.replica, mb.slot, mb.compact_tokens

Guarantees: every trajectory is in exactly one microbatch; microbatches are nonempty and within capacity; K is a
multiple of D and every replica runs exactly K / D microbatches, one per slot. Candidates are ranked
lexicographically by HARTS eq. 4: (total work, sum over slots of the heaviest microbatch, heaviest replica total),
then by fewer slots (HARTS leaves ties open; each microbatch has fixed costs: a layout, launches, FSDP gathers).

Search, in order (all trajectory sets are handled as lexicographic ranks, planner/lcp_index.py):
 1. contiguous candidates (planner/microbatch/search.py): when K_min * N <= `exact_cells`, the exact minimum-work
    contiguous partition over every K that is a multiple of D (one DP indexed by K mod D); otherwise HARTS's natural
    partition evolved by merges/splits to at most `q_max` sampled K of eq. 8. Each gets boundary refinement
    (`window`, `sweeps`), which can only rebalance an exact partition.
 2. the trie-aware greedy candidate (planner/microbatch/greedy.py), when N <= `greedy_max_n`.
 3. the `anchors` candidates of least work are refined without contiguity (planner/microbatch/refine.py): light
    microbatches are dissolved into others while that adds no work; every K on the way that is a multiple of D is
    kept (a final unaligned K is aligned by the cheaper of cuts and further dissolving), and the last (least work)
    gets sparse repair (moves and swaps within `window` ranks, `repair_iterations` at most).
 4. the candidates of least total work are balanced by moving whole prefix-disjoint subtrees between microbatches,
    which never adds work (planner/microbatch/balance.py).
 5. every candidate gets HARTS's greedy replica and slot assignment (`assign_slots`); the least by eq. 4 is returned.
Step 1's DP is exact over contiguous partitions; steps 2-5 and the assignment are heuristics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from planner.lcp_index import LcpIndex
from planner.microbatch.balance import balance_atoms
from planner.microbatch.greedy import trie_greedy
from planner.microbatch.refine import Grouping, eliminate_small, refine_boundaries, sparse_repair
from planner.microbatch.search import evolve, exact_dp, k_candidates, natural_partition, sample_ks
from planner.replica_share import ReplicaShare, check_replica, forward_backward_events
from planner.trajectory import Trajectory, check_trajectories

__all__ = ["PlannedMicrobatch", "MicrobatchPlan", "plan_microbatches", "assign_slots", "slot_work", "objective",
           "imbalance", "plan_from_groups", "check_inputs"]


@dataclass(frozen=True)
class PlannedMicrobatch:
    """One microbatch of a plan: input indices of its trajectories (ascending), where it runs, its compact work."""

    trajectories: tuple[int, ...]
    replica: int
    slot: int
    compact_tokens: int
    flat: bool = False
    """Run as its flat expansion (trajectory-wise, nothing shared) instead of its trie: auto mode's choice by the
    cost model (`planner.microbatch.flat`)."""


@dataclass(frozen=True)
class MicrobatchPlan:
    """K microbatches ordered by (slot, replica); `method` names the candidate that won."""

    carries: ClassVar[bool] = False
    """Nothing crosses microbatches: each runs whole (`ReplicaShare.carries`)."""

    microbatches: tuple[PlannedMicrobatch, ...]
    dp: int
    capacity: int
    planning_seconds: float
    method: str

    @property
    def total_compact_tokens(self) -> int:
        return sum(mb.compact_tokens for mb in self.microbatches)

    @property
    def num_slots(self) -> int:
        return len(self.microbatches) // self.dp

    def _assignment(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(work, replica, slot) [K] int64 of the microbatches."""
        mbs = self.microbatches
        as_array = lambda values: np.fromiter(values, dtype=np.int64, count=len(mbs))  # noqa: E731
        return (as_array(mb.compact_tokens for mb in mbs), as_array(mb.replica for mb in mbs),
                as_array(mb.slot for mb in mbs))

    def slot_work(self) -> np.ndarray:
        """[J, D] int64: compact work of the microbatch replica d runs in slot j."""
        return slot_work(*self._assignment(), self.dp)

    def objective(self) -> tuple[int, int, int, int]:
        """HARTS eq. 4 and then the number of slots (`objective`)."""
        return objective(*self._assignment(), self.dp)

    def replica(self, dp_rank: int) -> ReplicaShare:
        """Replica `dp_rank`'s share (`planner.replica_share`): its microbatches in slot order, each one unit, whole
        (rows [0, compact work) of its trie), forward then backward."""
        check_replica(dp_rank, self.dp)
        mine = sorted((mb for mb in self.microbatches if mb.replica == dp_rank), key=lambda mb: mb.slot)
        return ReplicaShare(units=tuple(mb.trajectories for mb in mine),
                            parts=tuple(((k, 0, mb.compact_tokens),) for k, mb in enumerate(mine)),
                            events=forward_backward_events(len(mine)), carries=self.carries,
                            flat=tuple(mb.flat for mb in mine))

    def to_json(self) -> dict:
        return {
            "microbatches": [
                {"trajectories": list(mb.trajectories), "replica": mb.replica, "slot": mb.slot,
                 "compact_tokens": mb.compact_tokens, "flat": mb.flat}
                for mb in self.microbatches
            ],
            "total_compact_tokens": self.total_compact_tokens,
            "planning_seconds": self.planning_seconds,
        }


def check_inputs(trajectories: Sequence[Trajectory], capacity: int, dp: int, *, split_paths: bool = False
                 ) -> np.ndarray:
    """Validate planner inputs (shared with planner/microbatch/baselines.py and planner/carry/plan.py). Returns the
    lengths [N] int64.

    split_paths: the plan may cut a trajectory anywhere and leave replicas empty (carry mode), so neither a
    trajectory longer than `capacity` nor fewer trajectories than `dp` is an error.
    """
    for name, value in (("capacity", capacity), ("dp", dp)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")
    if len(trajectories) == 0:
        raise ValueError("no trajectories to plan: the input is empty")
    check_trajectories(trajectories)
    lengths = np.fromiter((len(t) for t in trajectories), dtype=np.int64, count=len(trajectories))
    if split_paths:
        return lengths
    too_long = np.flatnonzero(lengths > capacity)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"trajectory {i} has {lengths[i]} tokens but capacity is {capacity} compact tokens per microbatch and a "
            f"trajectory cannot be split; {too_long.size} trajectories are too long, the longest has "
            f"{lengths.max()} tokens: use capacity >= {lengths.max()}"
        )
    if len(trajectories) < dp:
        raise ValueError(
            f"dp={dp} replicas need at least {dp} trajectories (each replica runs >= 1 nonempty microbatch), "
            f"got {len(trajectories)}: lower dp"
        )
    return lengths


def assign_slots(work: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """HARTS's replica and slot assignment: sort the K microbatches by work, heaviest first; slot j takes the j-th
    block of D; inside a slot the heavier microbatches go to the replicas with less cumulative work so far.
    Returns (replica [K], slot [K]) int64."""
    k = work.size
    order = np.argsort(-work, kind="stable")
    cumulative = np.zeros(dp, dtype=np.int64)
    replica = np.empty(k, dtype=np.int64)
    slot = np.empty(k, dtype=np.int64)
    for j in range(k // dp):
        block = order[j * dp : (j + 1) * dp]
        lightest_first = np.argsort(cumulative, kind="stable")
        replica[block] = lightest_first
        slot[block] = j
        cumulative[lightest_first] += work[block]
    return replica, slot


def slot_work(work: np.ndarray, replica: np.ndarray, slot: np.ndarray, dp: int) -> np.ndarray:
    """[J, D] int64: work [K] of the microbatch that replica d runs in slot j, from replica [K] and slot [K]."""
    w = np.zeros((work.size // dp, dp), dtype=np.int64)
    w[slot, replica] = work
    return w


def objective(work: np.ndarray, replica: np.ndarray, slot: np.ndarray, dp: int) -> tuple[int, int, int, int]:
    """HARTS eq. 4 of an assignment: (total work, sum over slots of the heaviest microbatch, heaviest replica's total
    work), then the number of slots: at equal work and balance, fewer microbatches pay fewer per-microbatch costs."""
    w = slot_work(work, replica, slot, dp)
    return int(w.sum()), int(w.max(axis=1).sum()), int(w.sum(axis=0).max()), w.shape[0]


def imbalance(work: np.ndarray) -> np.ndarray:
    """HARTS eq. 23 per row of `work` [rows, D] (e.g. `slot_work`): max / mean - 1, 0 for an all-zero row."""
    mean = work.mean(axis=1)
    return np.where(mean > 0, work.max(axis=1) / np.maximum(mean, 1e-12) - 1, 0.0)


def plan_from_groups(groups: list[np.ndarray], work: np.ndarray, replica: np.ndarray, slot: np.ndarray, dp: int,
                     capacity: int, seconds: float, method: str) -> MicrobatchPlan:
    """Build a MicrobatchPlan from input-index groups and their assignment."""
    mbs = [PlannedMicrobatch(tuple(sorted(int(i) for i in g)), int(r), int(s), int(w))
           for g, w, r, s in zip(groups, work, replica, slot)]
    mbs.sort(key=lambda mb: (mb.slot, mb.replica))
    return MicrobatchPlan(tuple(mbs), dp, capacity, seconds, method)


def _contiguous_candidates(index: LcpIndex, capacity: int, dp: int, *, exact_cells: int, q_max: int, window: int,
                           sweeps: int) -> list[tuple[str, Grouping]]:
    k_min = dp * max(1, -(-index.total_work // (capacity * dp)))
    if k_min * index.size <= exact_cells:
        starts = exact_dp(index, capacity, dp)
        found = {} if starts is None else {"exact-dp": starts}
    else:
        p0 = natural_partition(index, capacity)
        ks = sample_ks(k_candidates(index, capacity, dp, p0.size), q_max)
        found = {f"evolve-K{k}": st for k, st in evolve(index, capacity, p0, ks).items()}
    return [(name, Grouping.from_starts(index, refine_boundaries(index, capacity, st, window, sweeps)))
            for name, st in found.items()]


def plan_microbatches(
    trajectories: Sequence[Trajectory],
    capacity: int,
    dp: int,
    *,
    window: int = 8,
    sweeps: int = 2,
    repair_iterations: int = 4,
    q_max: int = 32,
    exact_cells: int = 4_000_000,
    greedy_max_n: int = 512,
    anchors: int = 3,
) -> MicrobatchPlan:
    """Plan K microbatches of `trajectories` for `dp` DP replicas with at most `capacity` compact tokens each.

    Args:
        trajectories: root-to-leaf paths from any number of trees.
        capacity: T, unique compact tokens per microbatch (every trajectory must fit alone).
        dp: D, the DP degree; K is a multiple of D.
        window, sweeps: boundary refinement (HARTS H = 8, 2 sweeps); `window` is also sparse repair's H.
        repair_iterations: sparse repair iterations (HARTS: 4).
        q_max: sampled K values of the evolution path (HARTS: 32).
        exact_cells: use the exact DP when K_min * N is at most this (its cost grows with K* N log N).
        greedy_max_n: build HARTS's trie-aware greedy candidate when N is at most this (HARTS: always; on SWE-like
            steps of ~2,000 paths it is slower and worse than the exact DP, so it is skipped there: bench/RESULTS.md,
            "Microbatch planner").
        anchors: candidates of least work refined without contiguity (HARTS: 3).
    Raises:
        ValueError / TypeError: empty input, dp or capacity < 1, a trajectory longer than capacity (the message
        names it and the capacity needed), fewer trajectories than dp, or no multiple of dp microbatches fits.
    """
    start = time.perf_counter()
    check_inputs(trajectories, capacity, dp)
    index = LcpIndex.from_trajectories(trajectories)
    candidates = _contiguous_candidates(index, capacity, dp, exact_cells=exact_cells, q_max=q_max, window=window,
                                        sweeps=sweeps)
    if index.size <= greedy_max_n:
        found = trie_greedy(index, capacity, dp)
        if found is not None:
            candidates.append(found)
    if not candidates:
        raise ValueError(
            f"no plan with a multiple of dp={dp} nonempty microbatches of at most {capacity} compact tokens was found "
            f"for {index.size} trajectories: raise capacity or lower dp"
        )
    for name, g in sorted(candidates, key=lambda c: c[1].total)[:anchors]:
        reduced = eliminate_small(g, capacity, dp)
        candidates += [(f"{name}+eliminate-K{e.k}", e) for e in reduced[1:-1]]
        repaired = sparse_repair(reduced[-1], capacity, window, repair_iterations)
        candidates.append((f"{name}+eliminate-K{reduced[-1].k}+repair", repaired))
    least = min(g.total for _, g in candidates)
    candidates += [(f"{name}+balance", balance_atoms(g, capacity)) for name, g in candidates if g.total == least]
    best = None
    for name, g in candidates:
        replica, slot = assign_slots(g.work, dp)
        key = objective(g.work, replica, slot, dp)
        if best is None or key < best[0]:
            best = (key, name, g, replica, slot)
    _, name, g, replica, slot = best
    groups = [index.order[ranks] for ranks in g.groups()]
    return plan_from_groups(groups, g.work, replica, slot, dp, capacity, time.perf_counter() - start, name)
