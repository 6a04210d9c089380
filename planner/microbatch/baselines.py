"""Peer microbatch planners, for comparison with planner.microbatch.plan only (bench/planner.py). Not used for training.

Legend: N trajectories, K microbatches, D DP replicas, T capacity. Every baseline returns a MicrobatchPlan whose
microbatches are nonempty, cover every trajectory once and hold at most T tokens of work, K being a multiple of D and
every replica running K / D of them. Work is compact (unique trie) tokens, except for `trajectory_wise_plan`, which
executes every token of every trajectory. Trees come from Trajectory.tree (a trajectory without one is its own tree).

  ortools_plan      Tree Training as HARTS §5.2 rebuilt it: trees to replicas by first-fit decreasing, a capacity
                    partition with OR-Tools inside each replica, extra splits until replicas have equal counts.
  dta_plan          AReaL-DTA: the lexicographic (DFS) order cut into K contiguous ranges, binary search on the
                    maximum range cost; replica d takes the d-th block of K / D consecutive ranges.
  areal_plan        AReaL 1.0.4: trajectories to replicas by balanced_greedy_partition on token counts, then first-fit
                    in that order into tries of at most T tokens (_greedy_build_tries), extra splits to equal counts.
  trajectory_wise_plan  no sharing: trajectories packed by first-fit decreasing on their lengths.

The Tree Training partitioner itself is not public (notes/peers.md). What we run: each tree heavier than T is cut into
fragments by its depth-first order (consecutive paths join the current fragment while it fits, as a DFS-serialised
tree is cut into memory-fitting subtrees); then CP-SAT packs each replica's fragments into the fewest bins of
capacity T with additive fragment sizes (a fragment's size counts its own prefix; two fragments of one tree in one bin
are charged their shared prefix once in the reported work, not in the packing model). Its time limit (`time_limit`,
per replica, one worker) bounds its planning time.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import Sequence

import numpy as np
from ortools.sat.python import cp_model

from planner.lcp_index import LcpIndex
from planner.microbatch.plan import MicrobatchPlan, assign_slots, check_inputs, plan_from_groups
from planner.trajectory import Trajectory

__all__ = ["ortools_plan", "dta_plan", "areal_plan", "trajectory_wise_plan", "BASELINES"]


def _trees(trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
    """Input indices of each tree, in order of first appearance."""
    trees: dict = defaultdict(list)
    for i, t in enumerate(trajectories):
        trees[("tree", t.tree) if t.tree is not None else ("alone", i)].append(i)
    return [np.asarray(v, dtype=np.int64) for v in trees.values()]


def _split_cost(index: LcpIndex, ranks: np.ndarray) -> tuple[int, int]:
    """Cheapest cut of a microbatch (sorted ranks, >= 2): (work increase = LCP at the cut, position of the cut)."""
    shared = index.pair_lcp(ranks[:-1], ranks[1:])
    i = int(np.argmin(shared))
    return int(shared[i]), i + 1


def _split_cheapest(index: LcpIndex, mbs: list[np.ndarray]) -> bool:
    """Split the microbatch with the cheapest cut in two; False if all are single trajectories."""
    splittable = [j for j, m in enumerate(mbs) if m.size >= 2]
    if not splittable:
        return False
    best = min(splittable, key=lambda j: _split_cost(index, mbs[j])[0])
    cut = _split_cost(index, mbs[best])[1]
    ranks = mbs.pop(best)
    mbs += [ranks[:cut], ranks[cut:]]
    return True


def _equalize(index: LcpIndex, replicas: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Split microbatches (cheapest cut first) until every replica has as many as the largest one. A replica with too
    few trajectories for that makes us pool all microbatches, split to a multiple of D, and deal them heaviest first
    to the replica with the least work among those still short of K / D."""
    target = max(len(mbs) for mbs in replicas)
    if all(sum(m.size for m in mbs) >= target for mbs in replicas):
        for mbs in replicas:
            while len(mbs) < target:
                _split_cheapest(index, mbs)
        return replicas
    dp = len(replicas)
    pool = [m for mbs in replicas for m in mbs]
    while len(pool) % dp and _split_cheapest(index, pool):
        pass
    if len(pool) % dp:
        raise ValueError(f"too few trajectories to give {dp} replicas the same number of microbatches")
    per = len(pool) // dp
    dealt: list[list[np.ndarray]] = [[] for _ in range(dp)]
    load = [0] * dp
    for m in sorted(pool, key=lambda m: -index.set_work(m)):
        d = min((d for d in range(dp) if len(dealt[d]) < per), key=lambda d: load[d])
        dealt[d].append(m)
        load[d] += index.set_work(m)
    return dealt


def _plan_from_replicas(index: LcpIndex, replicas: list[list[np.ndarray]], dp: int, capacity: int, start: float,
                        method: str) -> MicrobatchPlan:
    """Slots inside each replica in descending work (slot j holds every replica's j-th heaviest microbatch)."""
    groups, work, replica, slot = [], [], [], []
    for d, mbs in enumerate(replicas):
        w = [index.set_work(m) for m in mbs]
        for j, m in enumerate(np.argsort(w, kind="stable")[::-1]):
            groups.append(index.order[mbs[m]])
            work.append(w[m])
            replica.append(d)
            slot.append(j)
    return plan_from_groups(groups, np.asarray(work), np.asarray(replica), np.asarray(slot), dp, capacity,
                            time.perf_counter() - start, method)


def _fragments(index: LcpIndex, ranks: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Cut one tree (its sorted ranks) into subtree fragments of work <= capacity: consecutive paths of its
    depth-first (lexicographic) order are added to the current fragment while it fits."""
    added = index.lengths[ranks].copy()
    added[1:] -= index.pair_lcp(ranks[:-1], ranks[1:])  # work each path adds to its predecessors
    out, first, work = [], 0, int(added[0])
    for j in range(1, ranks.size):
        if work + added[j] > capacity:
            out.append(ranks[first:j])
            first, work = j, int(index.lengths[ranks[j]])
        else:
            work += int(added[j])
    out.append(ranks[first:])
    return out


def _first_fit_decreasing(sizes: list[int], capacity: int) -> tuple[list[list[int]], list[int]]:
    """Items largest first (stable), each into the first bin it fits in. Returns the bins (item indices in placement
    order) and their loads."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = next((b for b, load in enumerate(loads) if load + sizes[i] <= capacity), None)
        if b is None:
            bins.append([i])
            loads.append(sizes[i])
        else:
            bins[b].append(i)
            loads[b] += sizes[i]
    return bins, loads


def _bin_pack(sizes: list[int], capacity: int, time_limit: float) -> tuple[list[list[int]], bool]:
    """Fewest bins of `capacity` for items of `sizes` with CP-SAT (first-fit decreasing as hint and upper bound).
    Returns the bins (item indices) and whether CP-SAT proved them optimal within `time_limit` seconds."""
    ffd, _ = _first_fit_decreasing(sizes, capacity)
    n_bins = len(ffd)
    model = cp_model.CpModel()
    x = {(i, b): model.NewBoolVar(f"x{i}_{b}") for i in range(len(sizes)) for b in range(n_bins)}
    used = [model.NewBoolVar(f"y{b}") for b in range(n_bins)]
    for i in range(len(sizes)):
        model.AddExactlyOne(x[i, b] for b in range(n_bins))
    for b in range(n_bins):
        model.Add(sum(sizes[i] * x[i, b] for i in range(len(sizes))) <= capacity * used[b])
        if b + 1 < n_bins:
            model.Add(used[b] >= used[b + 1])
    model.Minimize(sum(used))
    for b, items in enumerate(ffd):
        model.AddHint(used[b], 1)
        for i in range(len(sizes)):
            model.AddHint(x[i, b], int(i in items))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ffd, False
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for (i, b), var in x.items():
        if solver.Value(var):
            bins[b].append(i)
    return [b for b in bins if b], status == cp_model.OPTIMAL


def ortools_plan(trajectories: Sequence[Trajectory], capacity: int, dp: int, *,
                 time_limit: float = 10.0) -> MicrobatchPlan:
    """Tree Training-style planning as HARTS §5.2 built its baseline (see the module docstring)."""
    start = time.perf_counter()
    check_inputs(trajectories, capacity, dp)
    index = LcpIndex.from_trajectories(trajectories)
    trees = [np.sort(index.rank[t]) for t in _trees(trajectories)]
    tree_work = [index.set_work(t) for t in trees]
    # Shard-level first-fit decreasing: fill replicas up to an equal share; what fits nowhere goes to the least loaded.
    share = -(-sum(tree_work) // dp)
    loads = [0] * dp
    members: list[list[int]] = [[] for _ in range(dp)]
    for t in sorted(range(len(trees)), key=lambda t: -tree_work[t]):
        d = next((d for d in range(dp) if loads[d] + tree_work[t] <= share), int(np.argmin(loads)))
        members[d].append(t)
        loads[d] += tree_work[t]
    replicas, proven = [], 0
    for d in range(dp):
        frags = [f for t in members[d] for f in _fragments(index, trees[t], capacity)]
        bins, optimal = _bin_pack([index.set_work(f) for f in frags], capacity, time_limit) if frags else ([], True)
        proven += optimal
        replicas.append([np.sort(np.concatenate([frags[i] for i in b])) for b in bins])
    method = f"ortools (CP-SAT proved {proven} of {dp} replicas optimal, limit {time_limit:g} s each)"
    return _plan_from_replicas(index, _equalize(index, replicas), dp, capacity, start, method)


def _greedy_ranges(index: LcpIndex, limit: int) -> list[int]:
    """Starts of the contiguous ranges of the lexicographic order filled greedily up to `limit` work each."""
    starts, a = [0], 0
    for r in range(1, index.size):
        if index.interval_work(a, r) > limit:
            starts.append(r)
            a = r
    return starts


def dta_plan(trajectories: Sequence[Trajectory], capacity: int, dp: int) -> MicrobatchPlan:
    """AReaL-DTA's load-balanced contiguous DFS split (see the module docstring): K is the smallest multiple of D
    that capacity allows, and the largest range's work is minimised by binary search."""
    start = time.perf_counter()
    check_inputs(trajectories, capacity, dp)
    index = LcpIndex.from_trajectories(trajectories)
    k = dp * -(-len(_greedy_ranges(index, capacity)) // dp)
    lo, hi = int(index.lengths.max()), capacity
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_ranges(index, mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    starts = _greedy_ranges(index, lo)
    ends = starts[1:] + [index.size]
    ranges = [np.arange(a, b) for a, b in zip(starts, ends)]
    while len(ranges) < k:
        splittable = [j for j in range(len(ranges)) if ranges[j].size >= 2]
        if not splittable:
            raise ValueError(
                f"areal-dta: {len(trajectories)} trajectories cannot be split into {k} microbatches (a multiple of "
                f"dp={dp}): too few trajectories for this capacity"
            )
        j = max(splittable, key=lambda j: index.set_work(ranges[j]))
        cut = _split_cost(index, ranges[j])[1]
        ranks = ranges.pop(j)
        ranges[j:j] = [ranks[:cut], ranks[cut:]]
    per = k // dp
    groups = [index.order[r] for r in ranges]
    work = np.array([index.set_work(r) for r in ranges])
    replica = np.repeat(np.arange(dp), per)
    slot = np.tile(np.arange(per), dp)
    return plan_from_groups(groups, work, replica, slot, dp, capacity, time.perf_counter() - start, "areal-dta")


def _balanced_greedy_partition(lengths: np.ndarray, dp: int) -> list[list[int]]:
    """AReaL's balanced_greedy_partition: longest first, each to the non-full replica with the fewest tokens (a
    replica is full at ceil(N / D) trajectories; AReaL requires N % D == 0)."""
    per = -(-lengths.size // dp)
    groups: list[list[int]] = [[] for _ in range(dp)]
    sums = [0] * dp
    for i in sorted(range(lengths.size), key=lambda i: -lengths[i]):
        d = min((d for d in range(dp) if len(groups[d]) < per), key=lambda d: sums[d])
        groups[d].append(i)
        sums[d] += int(lengths[i])
    return groups


def areal_plan(trajectories: Sequence[Trajectory], capacity: int, dp: int) -> MicrobatchPlan:
    """AReaL 1.0.4 tree packing (see the module docstring)."""
    start = time.perf_counter()
    lengths = check_inputs(trajectories, capacity, dp)
    index = LcpIndex.from_trajectories(trajectories)
    replicas = []
    for members in _balanced_greedy_partition(lengths, dp):
        tries: list[list[int]] = []  # sorted ranks of each trie
        work: list[int] = []
        for i in members:
            r = int(index.rank[i])
            for t, ranks in enumerate(tries):
                pos = bisect.bisect(ranks, r)
                shared = max(index.pair_lcp(ranks[pos - 1], r) if pos else 0,
                             index.pair_lcp(r, ranks[pos]) if pos < len(ranks) else 0)
                if work[t] + index.lengths[r] - shared <= capacity:
                    ranks.insert(pos, r)
                    work[t] += int(index.lengths[r] - shared)
                    break
            else:
                tries.append([r])
                work.append(int(index.lengths[r]))
        replicas.append([np.asarray(t, dtype=np.int64) for t in tries])
    return _plan_from_replicas(index, _equalize(index, replicas), dp, capacity, start, "areal-1.0.4")


def trajectory_wise_plan(trajectories: Sequence[Trajectory], capacity: int, dp: int) -> MicrobatchPlan:
    """No prefix sharing: first-fit decreasing on trajectory lengths into bins of `capacity` tokens; K is raised to a
    multiple of D by splitting off the shortest trajectory of the fullest splittable bin; HARTS's slot assignment."""
    start = time.perf_counter()
    lengths = check_inputs(trajectories, capacity, dp)
    bins, loads = _first_fit_decreasing(lengths.tolist(), capacity)
    while len(bins) % dp:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            raise ValueError(f"{len(bins)} single-trajectory bins cannot be split to a multiple of dp={dp}")
        b = max(splittable, key=lambda b: loads[b])
        i = bins[b].pop()  # the shortest: bins are filled longest first
        loads[b] -= int(lengths[i])
        bins.append([i])
        loads.append(int(lengths[i]))
    work = np.asarray(loads, dtype=np.int64)
    replica, slot = assign_slots(work, dp)
    groups = [np.asarray(b) for b in bins]
    return plan_from_groups(groups, work, replica, slot, dp, capacity, time.perf_counter() - start, "trajectory-wise")


BASELINES = {"ortools": ortools_plan, "areal-dta": dta_plan, "areal-1.0.4": areal_plan,
             "trajectory-wise": trajectory_wise_plan}
