"""The app's side of one optimizer step on this rank: this replica's microbatches with the per-position tensors the
app's losses read, and the clipped optimizer step.

Legend: S semantic positions of a microbatch (original order), D data-parallel replicas.

`prepare_step` (every rank) takes the microbatches that the step's plan (planner.microbatch.plan_microbatches with
the job's D, made once on rank 0) assigns to this replica, counts the step-global normalisers over all replicas
(`parallel.step.step_normalizer`), and packs each microbatch once (`parallel.step.pack_microbatch`): the layouts
serve every pass over the step (old and reference log-probs, several epochs). The passes themselves are
`parallel.step.train_step` and `parallel.step.score`, the same in one process (D = 1, no group) and under torchrun.
The losses (app.objectives) receive a microbatch's packed batch from `train_step` and look up its tensors here
(`StepPlan.inputs_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from models.decoder import DecoderOutput
from models.moe import MoEStats
from parallel.grad_norm import clip_grad_norm_
from parallel.pipeline import PipelinedCausalLM, pipeline_clip_grad_norm_
from parallel.step import (
    Microbatch, StepNormalizer, pack_microbatch, replica_microbatches, step_normalizer, token_weights,
)
from planner.microbatch import MicrobatchPlan
from planner.pack import CompactBatch
from planner.trajectory import Trajectory

__all__ = ["MicrobatchInputs", "StepPlan", "prepare_step", "optimizer_step", "pooled_moe_stats"]


@dataclass(eq=False)
class MicrobatchInputs:
    """What the losses read of one microbatch besides its batch, on the trainer device. Tensors are [S]."""

    token_weight: torch.Tensor
    """float64 loss weight: step-global normaliser x trajectory weight, 0 on untrained positions."""
    trained: torch.Tensor
    """bool: positions the loss trains (loss_mask without first tokens)."""
    token_share: float
    """This microbatch's semantic positions / those of the whole step (weights per-microbatch MoE aux losses)."""
    advantage: torch.Tensor
    """float64."""
    rollout_logprobs: torch.Tensor | None = None
    """Behaviour log-probs from the rollout engine (0 where the engine sampled nothing), or None."""
    old_logprobs: torch.Tensor | None = None
    """The trainer's log-probs before this step's first update (`StepPlan.set_old_logprobs`, rl.epochs > 1)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-policy log-probs (`StepPlan.set_ref_logprobs`, when a KL term is on)."""


@dataclass
class StepPlan:
    """This replica's microbatches of one step (slot order) and their loss inputs."""

    microbatches: list[Microbatch]
    inputs: list[MicrobatchInputs]
    normalizer: StepNormalizer

    def __post_init__(self) -> None:
        self._index = {id(mb.batch): i for i, mb in enumerate(self.microbatches)}

    def inputs_of(self, batch: CompactBatch) -> MicrobatchInputs:
        """The inputs of the microbatch whose packed batch `parallel.step.train_step` handed to the loss."""
        return self.inputs[self._index[id(batch)]]

    def set_old_logprobs(self, scored: Sequence[torch.Tensor]) -> None:
        for inputs, logprobs in zip(self.inputs, scored, strict=True):
            inputs.old_logprobs = logprobs

    def set_ref_logprobs(self, scored: Sequence[torch.Tensor]) -> None:
        for inputs, logprobs in zip(self.inputs, scored, strict=True):
            inputs.ref_logprobs = logprobs


def _optional(values: np.ndarray | None, device) -> torch.Tensor | None:
    if values is None:
        return None
    return torch.as_tensor(np.nan_to_num(values, nan=0.0), dtype=torch.float64, device=device)


def prepare_step(
    trajectories: Sequence[Trajectory],
    plan: MicrobatchPlan,
    *,
    dp_rank: int,
    dp_group: dist.ProcessGroup | None,
    model_config,
    aggregation: Literal["token-mean", "seq-mean-token-mean"],
    device: torch.device,
) -> StepPlan:
    """This replica's share of the step `plan` (made over all of `trajectories` with the job's D), packed."""
    groups = replica_microbatches(plan, trajectories, dp_rank)
    normalizer = step_normalizer(groups, dp_group, device)
    total = sum(len(t) for t in trajectories)
    microbatches, inputs = [], []
    for group in groups:
        mb = pack_microbatch(group, model_config, device)
        batch = mb.batch
        microbatches.append(mb)
        inputs.append(MicrobatchInputs(
            token_weight=torch.as_tensor(token_weights(batch, normalizer, aggregation), device=device),
            trained=torch.as_tensor(batch.loss_mask, device=device),
            token_share=batch.num_semantic / total,
            advantage=torch.as_tensor(batch.advantage, dtype=torch.float64, device=device),
            rollout_logprobs=_optional(batch.logprobs, device),
            ref_logprobs=_optional(batch.ref_logprobs, device),
        ))
    return StepPlan(microbatches, inputs, normalizer)


def optimizer_step(model, optimizer: torch.optim.Optimizer, grad_clip: float) -> tuple[float, bool]:
    """Clip the global gradient norm (over every mesh of a parallelized model: `parallel.grad_norm`, and over the
    pipeline stages of a `parallel.pipeline.PipelinedCausalLM`) and step; a non-finite norm skips the update.
    Returns (norm, stepped). Gradients are zeroed either way."""
    clip = pipeline_clip_grad_norm_ if isinstance(model, PipelinedCausalLM) else clip_grad_norm_
    norm = clip(model, grad_clip if grad_clip > 0 else float("inf"))
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm), stepped


def pooled_moe_stats(output: DecoderOutput) -> MoEStats | None:
    """The router statistics of all MoE layers of one forward, pooled (transformers' load-balancing form)."""
    stats = [s for s in output.moe_stats if s is not None]
    if not stats:
        return None
    pooled = stats[0]
    for s in stats[1:]:
        pooled = pooled + s
    return pooled
