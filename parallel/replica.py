"""This data-parallel replica's step: its share of the step plan, prepared under the step's global normalisers.

Legend: D data-parallel replicas, K microbatches of this replica.

The step's plan (`planner.step_plan.plan_step` over all trajectories with the job's D, in any mode) is the same on
every rank (made on the main rank and broadcast, or made on each: the planner is deterministic). `prepare_step`
takes this replica's share of it (`plan.replica(dp_rank)`, `planner.replica_share.ReplicaShare`: units of
trajectories, each microbatch's parts of them in slot order, the events), sums the replicas' trained-token counts
into the step's `models.microbatch.StepNormalizer`, and prepares every microbatch once, as the plan says: a HARTS
plan's microbatch as its trie or its flat expansion (`models.microbatch.prepare_microbatch`), a carry plan's with
its links (`models.carry_microbatch.prepare_carry_step`). The result is one `models.step.Step` either way; its
layouts and loss inputs serve every pass over the step (old and reference log-probs, several epochs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from models.carry_microbatch import prepare_carry_step
from models.config import ModelConfig
from models.microbatch import Aggregation, StepNormalizer, prepare_microbatch, trained_counts
from models.step import Step
from planner.carry.plan import CarryPlan
from planner.microbatch.plan import MicrobatchPlan
from planner.trajectory import Trajectory

__all__ = ["step_normalizer", "prepare_step"]


def step_normalizer(groups: Sequence[Sequence[Trajectory]], dp_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> StepNormalizer:
    """Count this replica's trained tokens, trained trajectories and positions over its trajectory groups `groups`
    and sum them over the DP replicas (`dp_group`; None = this process holds the whole step)."""
    counts = torch.tensor(trained_counts([t for group in groups for t in group]), dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    return StepNormalizer(*map(float, counts.tolist()))


def prepare_step(
    trajectories: Sequence[Trajectory],
    plan: MicrobatchPlan | CarryPlan,
    *,
    dp_rank: int,
    dp_group: dist.ProcessGroup | None,
    model_config: ModelConfig,
    aggregation: Aggregation,
    device: torch.device,
) -> Step:
    """Replica `dp_rank`'s step of the step plan `plan` (made over `trajectories` with the job's DP degree): its
    microbatches in slot order with their loss inputs under the step's global normalisers (a collective over
    `dp_group`: every rank calls it), and its events."""
    share = plan.replica(dp_rank)
    units = [[trajectories[i] for i in unit] for unit in share.units]
    normalizer = step_normalizer(units, dp_group, device)
    if share.carries:
        return prepare_carry_step(units, share.parts, model_config, device, events=share.events,
                                  normalizer=normalizer, aggregation=aggregation)
    return Step.self_contained([
        prepare_microbatch(unit, model_config, device, normalizer=normalizer, aggregation=aggregation, flat=flat)
        for unit, flat in zip(units, share.flat)
    ])
