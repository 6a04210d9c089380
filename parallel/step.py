"""One optimizer step's forward and backward on this rank: the microbatches the planner gave its DP replica.

Legend: S semantic positions of a microbatch, C compact rows, D model dim, E experts.

Per microbatch, in the planner's slot order (the same number of microbatches on every replica, so the collectives
of FSDP2 / EP line up): pack -> plan_calls -> TreeLayout (`pack_microbatch`; done once per step when several passes
reuse the layouts) -> tree log-probs of the sampling distribution softmax(logits / temperature) -> loss ->
backward. Gradients accumulate in the parameters (call `optimizer.zero_grad()` before, `optimizer.step()` after).
`score` runs the same forward without a graph (old or reference log-probs). The same functions serve one process
(plain model, `dp_group=None`) and every rank of a parallelized job.

Loss scaling: the loss of a microbatch must already be divided by normalisers of the WHOLE step (all microbatches
of all replicas), e.g. `token_weights(batch, step_normalizer(...), aggregation)`. Then the step loss is the sum of
the microbatch losses over replicas, FSDP2 sums gradients (no averaging, `parallel.fsdp`), and the gradient equals
the single-process gradient of the whole step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.decoder import HybridForCausalLM, TreeLMOutput
from models.tree.layout import TreeLayout
from planner.calls import plan_calls
from planner.microbatch import MicrobatchPlan
from planner.pack import CompactBatch, pack
from planner.trajectory import Trajectory

__all__ = ["Microbatch", "MicrobatchLoss", "StepNormalizer", "StepMetrics", "pack_microbatch", "replica_microbatches",
           "step_normalizer", "token_weights", "train_step", "score"]


class MicrobatchLoss(Protocol):
    def __call__(
        self, logprobs_S: torch.Tensor, batch: CompactBatch, output: TreeLMOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one microbatch (already divided by the step's global normalisers) and detached metrics to sum
        over microbatches. `batch` holds the per-position metadata in original order (advantage, loss_mask,
        logprobs, weight, traj_index); `output.moe_stats` the multiplicity-weighted router statistics per layer,
        `output.entropy` the `[S]` entropies of the sampling distribution when `train_step(entropy=True)`."""


@dataclass(eq=False)
class Microbatch:
    """One microbatch packed for tree execution on the trainer device."""

    batch: CompactBatch
    layout: TreeLayout

    @property
    def linear_attention_calls(self) -> int:
        """Packed linear-attention kernel calls per layer (the plan's rounds, split where a round exports states
        from inside a sequence: `models.tree.core_calls`)."""
        return len(self.layout.linear_calls)


def pack_microbatch(trajectories: Sequence[Trajectory], model: ModelConfig, device: torch.device) -> Microbatch:
    """Pack `trajectories` into a trie and plan its tree execution with the model's linear-attention chunk size."""
    linear = model.linear_attention
    chunk_size = linear.chunk_size if linear is not None else 64
    conv_size = linear.conv_size if linear is not None else 1
    batch = pack(trajectories)
    return Microbatch(batch, TreeLayout.build(batch, plan_calls(batch, chunk_size), conv_size, device))


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
    """Packed linear-attention kernel calls per layer, summed over microbatches
    (`Microbatch.linear_attention_calls`)."""
    extras: dict[str, float] = field(default_factory=dict)
    """The loss function's metrics, summed."""
    expert_counts: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer: multiplicity-weighted expert assignment counts `[E]` (None for dense layers), the load that
    expert-bias updates use."""
    non_finite: int | None = None
    """Index (slot order) of this rank's first microbatch whose loss was NaN or inf, else None. The gradients are
    then unusable: the caller skips the optimizer step (the summed step loss is non-finite on every rank)."""
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    """Host time spent in forward (with the loss) and backward on this rank."""


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


def _checked(microbatches: Sequence, dp_group: dist.ProcessGroup | None, device: torch.device) -> None:
    if not microbatches:
        raise ValueError("`microbatches` is empty: every DP replica needs at least one microbatch per step")
    if dp_group is not None:
        _check_equal_counts(len(microbatches), dp_group, device)


def _step_metrics(batches: Sequence[CompactBatch], linear_attention_calls: int, losses_K: torch.Tensor,
                  extras: dict[str, float], expert_counts: list[torch.Tensor | None], forward_seconds: float,
                  backward_seconds: float) -> StepMetrics:
    """StepMetrics of this replica's microbatches (`batches`, in slot order) from their losses `[K]` (float64)."""
    finite_K = torch.isfinite(losses_K).cpu()
    return StepMetrics(
        loss=float(losses_K.sum()), microbatches=len(batches), compact_rows=sum(b.num_compact for b in batches),
        semantic_tokens=sum(b.num_semantic for b in batches), linear_attention_calls=linear_attention_calls,
        extras=extras, expert_counts=expert_counts,
        non_finite=None if bool(finite_K.all()) else int((~finite_K).nonzero()[0]),
        forward_seconds=forward_seconds, backward_seconds=backward_seconds,
    )


def train_step(
    model: HybridForCausalLM,
    microbatches: Sequence[Microbatch | Sequence[Trajectory]],
    loss_fn: MicrobatchLoss,
    *,
    dp_group: dist.ProcessGroup | None = None,
    attention_backend: str = "dense",
    chunk_rows: int | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> StepMetrics:
    """Forward and backward of this rank's microbatches, in order.

    Every microbatch runs forward and backward even after a non-finite loss (so that all ranks issue the same
    collectives); `StepMetrics.non_finite` names the first one.

    Args:
        model: a plain HybridForCausalLM (single process), one wrapped by `parallelize_hybrid`, or this rank's
            pipeline stages (`parallel.pipeline.PipelinedCausalLM`, run by `pipeline_train_step`).
        microbatches: this replica's microbatches in slot order: `Microbatch`es (`pack_microbatch`) or lists of
            trajectories (packed here).
        loss_fn: see `MicrobatchLoss`.
        dp_group: the data-parallel group (`meshes.dp.get_group()`); used to check that replicas run equally many
            microbatches. None for a single process.
        attention_backend: tree full-attention backend ("dense", "flex", "branch"; see models.tree.attention).
        chunk_rows: rows per vocabulary chunk of the log-probs (default: ~512 MiB of fp32 scratch).
        temperature: log-probs (and entropies) are those of softmax(logits / temperature).
        entropy: compute the `[S]` entropies (`output.entropy` of the loss function).
    """
    from parallel.pipeline import PipelinedCausalLM, pipeline_train_step  # parallel.pipeline imports this module

    if isinstance(model, PipelinedCausalLM):
        return pipeline_train_step(model, microbatches, loss_fn, dp_group=dp_group,
                                   attention_backend=attention_backend, chunk_rows=chunk_rows,
                                   temperature=temperature, entropy=entropy)
    device = next(model.parameters()).device
    _checked(microbatches, dp_group, device)
    extras: dict[str, torch.Tensor] = {}
    expert_counts: list[torch.Tensor | None] = []
    losses, batches = [], []
    calls = 0
    forward_seconds = backward_seconds = 0.0
    for item in microbatches:
        mb = item if isinstance(item, Microbatch) else pack_microbatch(item, model.config, device)
        start = time.perf_counter()
        output = model(mb.layout, attention_backend, chunk_rows=chunk_rows, entropy=entropy, temperature=temperature)
        loss, metrics = loss_fn(output.logprobs, mb.batch, output)
        middle = time.perf_counter()
        loss.backward()
        forward_seconds += middle - start
        backward_seconds += time.perf_counter() - middle
        losses.append(loss.detach().to(torch.float64))
        for k, v in metrics.items():
            extras[k] = extras.get(k, 0.0) + v.detach().to(torch.float64)
        counts = [None if s is None else s.expert_counts for s in output.moe_stats]
        expert_counts = counts if not expert_counts else [
            None if a is None else a + b for a, b in zip(expert_counts, counts)
        ]
        batches.append(mb.batch)
        calls += mb.linear_attention_calls
    return _step_metrics(batches, calls, torch.stack(losses), {k: float(v) for k, v in extras.items()}, expert_counts,
                         forward_seconds, backward_seconds)


@torch.no_grad()
def score(
    model: HybridForCausalLM,
    microbatches: Sequence[Microbatch],
    *,
    dp_group: dist.ProcessGroup | None = None,
    attention_backend: str = "dense",
    chunk_rows: int | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """`[S]` float64 log-probs of softmax(logits / temperature) for every microbatch under `model`, without a
    graph (old or reference log-probs). Arguments as `train_step`."""
    from parallel.pipeline import PipelinedCausalLM, pipeline_score  # parallel.pipeline imports this module

    if isinstance(model, PipelinedCausalLM):
        return pipeline_score(model, microbatches, dp_group=dp_group, attention_backend=attention_backend,
                              chunk_rows=chunk_rows, temperature=temperature)
    _checked(microbatches, dp_group, next(model.parameters()).device)
    return [model(mb.layout, attention_backend, chunk_rows=chunk_rows, temperature=temperature).logprobs.to(
        torch.float64) for mb in microbatches]
