"""This data-parallel replica's share of a step: its planned microbatches, prepared under the step's global
normalisers.

Legend: D data-parallel replicas, K microbatches of the step.

The step's plan (`planner.microbatch.plan.plan_microbatches` over all trajectories with the job's D) is the same on
every rank (made on the main rank and broadcast, or made on each: the planner is deterministic). Each replica
takes its microbatches in slot order, the replicas sum their trained-token counts into the step's
`models.microbatch.StepNormalizer`, and each microbatch is prepared once (`models.microbatch.prepare_microbatch`):
its layout and loss inputs serve every pass over the step (old and reference log-probs, several epochs).

In prefix-carry mode (`planner.mode = "carry"`, issue #17) the plan names trees and parts of them instead
(a CarryPlan: `trees`, `microbatches` with `parts`, `replica`, `slot`, and per replica its `events`);
`prepare_carry_replica` prepares this replica's carry microbatches and events
(`models.carry_microbatch.prepare_carry_step`). `prepare_planned` takes either plan (`planner.step_plan.plan_step`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from models.carry_microbatch import CarryStep, prepare_carry_step
from models.config import ModelConfig
from models.microbatch import Aggregation, Microbatch, StepNormalizer, prepare_microbatch, trained_counts
from planner.carry.plan import CarryPlan
from planner.cost_model import CostModel
from planner.microbatch.plan import MicrobatchPlan
from planner.trajectory import Trajectory

__all__ = ["replica_microbatches", "step_normalizer", "prepare_replica", "prepare_carry_replica", "prepare_planned"]


def replica_microbatches(plan: MicrobatchPlan, trajectories: Sequence[Trajectory],
                         dp_rank: int) -> list[list[Trajectory]]:
    """The microbatches `plan` (made over the step's `trajectories` with the job's DP degree) assigns to replica
    `dp_rank`, in slot order."""
    if not 0 <= dp_rank < plan.dp:
        raise ValueError(f"`dp_rank` {dp_rank} is outside the plan's {plan.dp} replicas: plan with the job's DP degree")
    mine = sorted((mb for mb in plan.microbatches if mb.replica == dp_rank), key=lambda mb: mb.slot)
    return [[trajectories[i] for i in mb.trajectories] for mb in mine]


def step_normalizer(groups: Sequence[Sequence[Trajectory]], dp_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> StepNormalizer:
    """Count this replica's trained tokens, trained trajectories and positions over its microbatches `groups` and
    sum them over the DP replicas (`dp_group`; None = this process holds the whole step)."""
    counts = torch.tensor(trained_counts([t for group in groups for t in group]), dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    return StepNormalizer(*map(float, counts.tolist()))


def prepare_replica(
    trajectories: Sequence[Trajectory],
    plan: MicrobatchPlan,
    *,
    dp_rank: int,
    dp_group: dist.ProcessGroup | None,
    model_config: ModelConfig,
    aggregation: Aggregation,
    device: torch.device,
    cost: CostModel | None = None,
) -> list[Microbatch]:
    """This replica's microbatches of the step `plan`, in slot order, each prepared with its loss inputs under the
    step's global normalisers (a collective over `dp_group`: every rank calls it); with a `cost` model, each runs as
    a trie or, when it predicts that faster and it fits the plan's capacity, as its flat expansion
    (`models.microbatch.prepare_microbatch`)."""
    groups = replica_microbatches(plan, trajectories, dp_rank)
    normalizer = step_normalizer(groups, dp_group, device)
    capacity = None if cost is None else plan.capacity
    return [prepare_microbatch(g, model_config, device, normalizer=normalizer, aggregation=aggregation, cost=cost,
                               capacity=capacity) for g in groups]


def prepare_carry_replica(
    trajectories: Sequence[Trajectory],
    plan,
    *,
    dp_rank: int,
    dp_group: dist.ProcessGroup | None,
    model_config: ModelConfig,
    aggregation: Aggregation,
    device: torch.device,
) -> CarryStep:
    """This replica's carry microbatches of the step's CarryPlan `plan` (made over `trajectories` with the job's
    DP degree) in slot order, and its events, with loss inputs under the step's global normalisers (a collective
    over `dp_group`: every rank calls it)."""
    if not 0 <= dp_rank < plan.dp:
        raise ValueError(f"`dp_rank` {dp_rank} is outside the plan's {plan.dp} replicas: plan with the job's DP degree")
    mine = sorted((mb for mb in plan.microbatches if mb.replica == dp_rank), key=lambda mb: mb.slot)
    slot_of = {mb.slot: k for k, mb in enumerate(mine)}
    trees = [[trajectories[i] for i in tree] for tree in plan.trees]
    used = sorted({p.tree for mb in mine for p in mb.parts})
    normalizer = step_normalizer([trees[t] for t in used], dp_group, device)
    events = [(kind, slot_of[slot] if slot >= 0 else -1) for kind, slot in plan.events[dp_rank]]
    return prepare_carry_step(trees, [mb.parts for mb in mine], model_config, device, events=events,
                              normalizer=normalizer, aggregation=aggregation)


def prepare_planned(trajectories: Sequence[Trajectory], plan: MicrobatchPlan | CarryPlan, *,
                    cost: CostModel | None = None, **kwargs) -> list[Microbatch] | CarryStep:
    """`prepare_carry_replica` for a CarryPlan, `prepare_replica` (with `cost`) for a MicrobatchPlan (same other
    keyword arguments); `parallel.carry_runner.CarryRunner` runs either result. Carry microbatches always run as
    tries (they read and export context)."""
    if isinstance(plan, CarryPlan):
        return prepare_carry_replica(trajectories, plan, **kwargs)
    return prepare_replica(trajectories, plan, cost=cost, **kwargs)
