"""One optimizer step's forward and backward on this rank: the microbatches the planner gave its DP replica.

Legend: S semantic positions of a microbatch, C compact rows, E experts.

Per microbatch, in the planner's slot order (the same number of microbatches on every replica, so the collectives
of FSDP2 / EP line up): pack -> plan_calls -> TreeLayout -> tree log-probs -> loss -> backward. Gradients accumulate
in the parameters (call `optimizer.zero_grad()` before, `optimizer.step()` after).

Loss scaling: the loss of a microbatch must already be divided by normalisers of the WHOLE step (all microbatches
of all replicas), e.g. `token_weights(batch, step_normalizer(...), aggregation)`. Then the step loss is the sum of
the microbatch losses over replicas, FSDP2 sums gradients (no averaging, `parallel.fsdp`), and the gradient equals
the single-process gradient of the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist

from models.decoder import DecoderOutput, HybridForCausalLM
from models.tree.execute import tree_logprobs
from models.tree.layout import TreeLayout
from planner.calls import plan_calls
from planner.microbatch import MicrobatchPlan
from planner.pack import CompactBatch, pack
from planner.trajectory import Trajectory

__all__ = ["MicrobatchLoss", "StepNormalizer", "StepMetrics", "replica_microbatches", "step_normalizer",
           "token_weights", "train_step"]


class MicrobatchLoss(Protocol):
    def __call__(
        self, logprobs_S: torch.Tensor, batch: CompactBatch, output: DecoderOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one microbatch (already divided by the step's global normalisers) and detached metrics to sum
        over microbatches. `batch` holds the per-position metadata in original order (advantage, loss_mask,
        logprobs, weight, traj_index); `output.moe_stats` the multiplicity-weighted router statistics per layer."""


@dataclass(frozen=True)
class StepNormalizer:
    """Global counts of one optimizer step, equal on every rank."""

    trained_tokens: float
    """Positions with loss_mask (first tokens excluded) over all trajectories of the step."""
    trained_trajectories: float
    """Trajectories with at least one trained position."""


@dataclass
class StepMetrics:
    """This rank's sums over its microbatches (sum over replicas for the step: `parallel.metrics.reduce_step`)."""

    loss: float
    microbatches: int
    compact_rows: int
    semantic_tokens: int
    linear_attention_calls: int
    """Packed linear-attention core calls per layer, summed over microbatches (rounds of the plans)."""
    extras: dict[str, float] = field(default_factory=dict)
    """The loss function's metrics, summed."""
    expert_counts: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer: multiplicity-weighted expert assignment counts `[E]` (None for dense layers), the load that
    expert-bias updates use."""


def replica_microbatches(plan: MicrobatchPlan, trajectories: Sequence[Trajectory],
                         dp_rank: int) -> list[list[Trajectory]]:
    """The microbatches `plan` (planner.microbatch.plan_microbatches over the step's `trajectories`, made with the
    job's DP degree) assigns to replica `dp_rank`, in slot order. Every rank must hold the same plan: plan on every
    rank from the same trajectories (the planner is deterministic) or broadcast it."""
    if not 0 <= dp_rank < plan.dp:
        raise ValueError(f"`dp_rank` {dp_rank} is outside the plan's {plan.dp} replicas: plan with the job's DP degree")
    mine = sorted((mb for mb in plan.microbatches if mb.replica == dp_rank), key=lambda mb: mb.slot)
    return [[trajectories[i] for i in mb.trajectories] for mb in mine]


def step_normalizer(microbatches: Sequence[Sequence[Trajectory]], dp_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> StepNormalizer:
    """Count this rank's trained tokens and trajectories and sum them over the DP replicas (`dp_group`; None = this
    process holds the whole step)."""
    trained = [int(np.count_nonzero(t.loss_mask[1:])) for mb in microbatches for t in mb]
    counts = torch.tensor([sum(trained), sum(n > 0 for n in trained)], dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    return StepNormalizer(float(counts[0]), float(counts[1]))


def token_weights(batch: CompactBatch, normalizer: StepNormalizer,
                  aggregation: Literal["token-mean", "seq-mean-token-mean"]) -> np.ndarray:
    """Per-position loss weights `[S]` (float64) of one microbatch under the step's global normalisers, times the
    trajectory weights: "token-mean" = 1 / trained_tokens; "seq-mean-token-mean" = 1 / (trained positions of the
    trajectory * trained_trajectories). Zero on untrained positions. Summed over all microbatches of the step these
    equal `app.losses.token_normalizers` over the whole step (times `weight`)."""
    mask = batch.loss_mask.astype(np.float64)
    if aggregation == "token-mean":
        w = mask / max(normalizer.trained_tokens, 1.0)
    elif aggregation == "seq-mean-token-mean":
        per_traj = np.bincount(batch.traj_index, weights=mask, minlength=batch.num_trajectories)
        w = mask / np.maximum(per_traj[batch.traj_index], 1.0) / max(normalizer.trained_trajectories, 1.0)
    else:
        raise ValueError(f"`aggregation` must be 'token-mean' or 'seq-mean-token-mean', got {aggregation!r}")
    return w * batch.weight


def _check_equal_counts(n: int, dp_group: dist.ProcessGroup, device: torch.device) -> None:
    t = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    if int(t[0]) != -int(t[1]):
        raise ValueError(
            f"DP replicas got between {-int(t[1])} and {int(t[0])} microbatches (this rank {n}): every replica must "
            "run the same number (plan with the DP degree, planner K mod D = 0)"
        )


def train_step(
    model: HybridForCausalLM,
    microbatches: Sequence[Sequence[Trajectory]],
    loss_fn: MicrobatchLoss,
    *,
    dp_group: dist.ProcessGroup | None = None,
    attention_backend: str = "dense",
    chunk_rows: int | None = None,
) -> StepMetrics:
    """Forward and backward of this rank's microbatches, in order.

    Args:
        model: a plain HybridForCausalLM (single process) or one wrapped by `parallelize_hybrid`.
        microbatches: this replica's microbatches in slot order, each a list of trajectories.
        loss_fn: see `MicrobatchLoss`.
        dp_group: the data-parallel group (`meshes.dp.get_group()`); used to check that replicas run equally many
            microbatches. None for a single process.
        attention_backend: tree full-attention backend ("dense", "flex", "branch"; see models.tree.attention).
        chunk_rows: rows per vocabulary chunk of the log-probs (default: ~512 MiB of fp32 scratch).
    """
    if not microbatches:
        raise ValueError("`microbatches` is empty: every DP replica needs at least one microbatch per step")
    device = next(model.parameters()).device
    if dp_group is not None:
        _check_equal_counts(len(microbatches), dp_group, device)
    linear = model.config.linear_attention
    chunk_size = linear.chunk_size if linear is not None else 64
    conv_size = linear.conv_size if linear is not None else 1
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    extras: dict[str, torch.Tensor] = {}
    expert_counts: list[torch.Tensor | None] = []
    rows = tokens = calls = 0
    for trajectories in microbatches:
        batch = pack(trajectories)
        plan = plan_calls(batch, chunk_size)
        layout = TreeLayout.build(batch, plan, conv_size, device)
        logprobs, output = tree_logprobs(model, layout, attention_backend, chunk_rows=chunk_rows)
        loss, metrics = loss_fn(logprobs, batch, output)
        loss.backward()
        loss_sum += loss.detach()
        for k, v in metrics.items():
            extras[k] = extras.get(k, 0.0) + v.detach().to(torch.float64)
        counts = [None if s is None else s.expert_counts for s in output.moe_stats]
        expert_counts = counts if not expert_counts else [
            None if a is None else a + b for a, b in zip(expert_counts, counts)
        ]
        rows += batch.num_compact
        tokens += batch.num_semantic
        calls += plan.num_rounds
    return StepMetrics(
        loss=float(loss_sum), microbatches=len(microbatches), compact_rows=rows, semantic_tokens=tokens,
        linear_attention_calls=calls, extras={k: float(v) for k, v in extras.items()}, expert_counts=expert_counts,
    )
