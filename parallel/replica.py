"""This data-parallel replica's share of a step: its planned microbatches, prepared under the step's global
normalisers.

Legend: D data-parallel replicas, K microbatches of the step.

The step's plan (`planner.microbatch.plan_microbatches` over all trajectories with the job's D) is the same on
every rank (made on the main rank and broadcast, or made on each: the planner is deterministic). Each replica
takes its microbatches in slot order, the replicas sum their trained-token counts into the step's
`models.microbatch.StepNormalizer`, and each microbatch is prepared once (`models.microbatch.prepare_microbatch`):
its layout and loss inputs serve every pass over the step (old and reference log-probs, several epochs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.microbatch import Aggregation, Microbatch, StepNormalizer, prepare_microbatch, trained_counts
from planner.microbatch import MicrobatchPlan
from planner.trajectory import Trajectory

__all__ = ["replica_microbatches", "step_normalizer", "prepare_replica"]


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
) -> list[Microbatch]:
    """This replica's microbatches of the step `plan`, in slot order, each prepared with its loss inputs under the
    step's global normalisers (a collective over `dp_group`: every rank calls it)."""
    groups = replica_microbatches(plan, trajectories, dp_rank)
    normalizer = step_normalizer(groups, dp_group, device)
    return [prepare_microbatch(g, model_config, device, normalizer=normalizer, aggregation=aggregation)
            for g in groups]
