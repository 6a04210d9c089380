"""One step's microbatch plan in a planner mode: "duplicate" (HARTS), "carry" (prefix carry) or "auto".

    plan = plan_step(trajectories, capacity=65_536, dp=4, mode="auto")  # MicrobatchPlan or CarryPlan
    share = plan.replica(d)  # either plan: replica d's share (planner/replica_share.py)

- duplicate: `planner.microbatch.plan.plan_microbatches`; trajectories are whole, a tree split over microbatches
  executes its shared prefix in each of them (a trajectory longer than the capacity is an error).
- carry: `planner.carry.plan.plan_carry`; every unique row once per tree (tree = planner/carry/balance.py's unit).
- auto: the carry plan, then for every tree larger than the capacity the cheaper of carrying it and duplicating it
  by the cost model (`CostModel.prefers_carry`): carrying adds the view rows of its cuts and the context rows its
  parts read; duplicating splits its trajectories into the contiguous groups of pack's order of at most T rows each
  that execute the fewest rows (exact over contiguous groupings), which adds their shared prefixes. A duplicated
  tree is then several trees that are never cut (one part each), on the carried tree's replica, and the step is laid
  out again, and that layout is kept if the cost model predicts the step faster than the carry plan
  (`CostModel.plan_seconds`: whole trees pack less tightly, which can cost a slot). Trees that fit in a microbatch need
  neither: the layout may still cut one to fill a microbatch, as in carry mode. When no tree is worth carrying the step
  gets the duplicate plan (whose search packs whole trajectories better than the carry layout; with fewer trajectories
  than replicas, which it refuses, the carry plan), with each microbatch marked to run as its trie or as its flat
  expansion, whichever the cost model predicts faster (`planner.microbatch.flat`: the one place auto mode's choices are
  made; preparation follows the plan). Deciding per tree is sound because what either choice adds is the tree's own work
  (rows and view rows of its microbatches) and carried context never crosses trees; what couples trees is only how the
  layout packs them, which the comparison of the whole step's layouts accounts for.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Literal, Sequence

import numpy as np

from planner.carry.balance import Unit, balance_units
from planner.carry.plan import CarryPlan, SortedStep, plan_carry, plan_units
from planner.cost_model import CostModel
from planner.microbatch.flat import with_flat_choices
from planner.microbatch.plan import MicrobatchPlan, check_inputs, plan_microbatches
from planner.trajectory import Trajectory

__all__ = ["MODES", "Mode", "plan_step", "duplicate_groups", "longest_trajectory"]

Mode = Literal["duplicate", "carry", "auto"]
MODES: tuple[str, ...] = ("duplicate", "carry", "auto")


def longest_trajectory(mode: str, capacity: int) -> int | None:
    """The longest trajectory a plan in `mode` takes with microbatches of `capacity` compact tokens: `capacity` in
    "duplicate" mode, which runs every trajectory whole in one microbatch; None (no limit) in "carry" and "auto",
    which cut trajectories. The one home of this rule: the planner's input checks, the RL job's config and preflight
    checks and the offline job's record limits ask here."""
    return capacity if mode == "duplicate" else None


def duplicate_groups(step: SortedStep, unit: Unit, capacity: int) -> list[Unit] | None:
    """The contiguous rank groups of `unit` of at most `capacity` rows each that execute the fewest rows in all
    (dynamic programme over group ends, O(n^2) for n trajectories); None when a trajectory is longer."""
    lo, hi = unit.lo, unit.hi
    length = step.length[lo:hi]
    if length.max() > capacity:
        return None
    new = length - step.lcp[lo:hi]
    before = np.concatenate([[0], np.cumsum(new)])  # rows ranks lo.. add before each local rank
    n = hi - lo
    best = np.full(n + 1, np.iinfo(np.int64).max, dtype=np.int64)
    start_of = np.zeros(n + 1, dtype=np.int64)
    best[0] = 0
    for b in range(1, n + 1):
        a = np.arange(b)
        rows = length[a] + before[b] - before[a + 1]  # group a..b-1: its first trajectory whole
        cost = np.where(rows <= capacity, best[a] + rows, np.iinfo(np.int64).max)
        start_of[b] = int(np.argmin(cost))
        best[b] = cost[start_of[b]]
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(int(start_of[bounds[-1]]))
    bounds = bounds[::-1]
    return [Unit(lo + a, lo + b, int(length[a] + before[b] - before[a + 1]), unit.replica)
            for a, b in zip(bounds[:-1], bounds[1:])]


def _auto(trajectories: Sequence[Trajectory], capacity: int, dp: int, cost: CostModel, start: float
          ) -> MicrobatchPlan | CarryPlan:
    step = SortedStep.from_trajectories(trajectories)
    units = balance_units(step.lcp, step.length, dp)
    carried = plan_units(step, units, [False] * len(units), capacity, dp, start, "carry")
    context = np.zeros(len(units), dtype=np.int64)
    for mb in carried.microbatches:
        for p in mb.parts:
            context[p.tree] += p.context_rows
    out, whole, any_carried = [], [], False
    for u, unit in enumerate(units):
        groups = duplicate_groups(step, unit, capacity) if unit.rows > capacity else None
        duplicated = sum(g.rows for g in groups) - unit.rows if groups is not None else 0
        if groups is not None and not cost.prefers_carry(carried.tree_extra_view_rows[u], int(context[u]),
                                                         duplicated):
            out += groups
            whole += [True] * len(groups)
        else:
            out.append(unit)
            whole.append(False)
            any_carried |= unit.rows > capacity
    if not any_carried:
        if len(trajectories) < dp:
            return carried
        return with_flat_choices(plan_microbatches(trajectories, capacity, dp), trajectories, cost)
    if all(not w for w in whole):
        return carried
    mixed = plan_units(step, out, whole, capacity, dp, start, "auto")
    best = mixed if _seconds(mixed, cost) < _seconds(carried, cost) else carried
    return dataclasses.replace(best, planning_seconds=time.perf_counter() - start)


def _seconds(plan: CarryPlan, cost: CostModel) -> float:
    context = sum(p.context_rows for mb in plan.microbatches for p in mb.parts)
    return cost.plan_seconds(plan.slot_work(), plan.extra_view_rows, context)


def plan_step(trajectories: Sequence[Trajectory], capacity: int, dp: int, mode: Mode = "duplicate", *,
              cost: CostModel | None = None) -> MicrobatchPlan | CarryPlan:
    """Plan one step in `mode` (see the module docstring); `cost` (default CostModel()) decides auto's choices."""
    if mode == "duplicate":
        return plan_microbatches(trajectories, capacity, dp)
    if mode == "carry":
        return plan_carry(trajectories, capacity, dp)
    if mode == "auto":
        start = time.perf_counter()
        check_inputs(trajectories, capacity, dp, split_paths=True)
        return _auto(trajectories, capacity, dp, cost or CostModel(), start)
    raise ValueError(f"`mode` must be one of {', '.join(MODES)}, got {mode!r}")
