"""The step runner contract: how the trainer runs one optimizer step's microbatches on this rank, whatever the model's
wrapping. `parallel.plain_runner.PlainRunner` (the whole model: one process, or TP/EP/FSDP2 ranks) and
`parallel.pipeline_runner.PipelineRunner` (this rank's pipeline stages) implement it; the trainer builds the one
its launch needs once and calls nothing else (the way vLLM's engine drives any `WorkerBase`).

Legend: S semantic positions of a microbatch, E experts.

Per step, a `models.step.Step` (its microbatches in slot order and their forward and backward events, one type for
every planner mode; the same kinds of events on every replica, so the collectives of FSDP2 / EP line up): tree
log-probs of softmax(logits / temperature) -> loss -> backward, gradients accumulating in the parameters (the caller
zeroes them before and steps the optimizer after). `score` runs the forwards without a graph (old or reference
log-probs). Steps come prepared (`parallel.replica.prepare_step`), each microbatch with its own loss inputs.

Loss scaling: the loss of a microbatch is already divided by normalisers of the WHOLE step
(`models.microbatch.token_weights`). The step loss is then the sum of the microbatch losses over replicas,
FSDP2 sums gradients (no averaging, `parallel.fsdp`), and the gradient equals the single-process gradient of the
whole step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from models.decoder import DecoderLayer, TreeLMOutput
from models.microbatch import Microbatch
from models.step import Step

__all__ = ["MicrobatchLoss", "StepMetrics", "StepRunner", "StepSums", "check_step", "step_metrics"]


class MicrobatchLoss(Protocol):
    def __call__(
        self, logprobs_S: torch.Tensor, mb: Microbatch, output: TreeLMOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one microbatch (already divided by the step's global normalisers) and detached metrics to sum
        over microbatches. `mb.loss` holds its loss inputs, `mb.batches` the per-position metadata in original order;
        `output.moe_stats` the multiplicity-weighted router statistics per layer, `output.entropy` the `[S]`
        entropies of the sampling distribution when `train_step(entropy=True)`."""


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
    flat_microbatches: int = 0
    """Microbatches run as their flat expansion (`Microbatch.flat`)."""
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


class StepRunner(Protocol):
    """Runs this rank's microbatches of a step on its part of the model."""

    model: nn.Module
    """The module whose parameters this rank trains (optimizer, checkpoints): the plain or parallelized model, or
    this rank's pipeline stages under the whole model's parameter names."""

    def train_step(self, step: Step, loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
                   entropy: bool = False) -> StepMetrics:
        """Forward and backward of this replica's microbatches. Every microbatch runs even after a non-finite loss
        (all ranks issue the same collectives); `StepMetrics.non_finite` names the first one."""

    def score(self, step: Step, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """`[S]` float64 log-probs of softmax(logits / temperature) of every microbatch (slot order), without a
        graph."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients of the whole model (every mesh, every stage) to a global norm of at most
        `max_norm`; returns the norm before clipping, equal on every rank."""

    def decoder_layers(self) -> dict[int, DecoderLayer]:
        """This rank's decoder layers by their index in the whole model (expert-bias updates)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict gathered from every rank's shards and stages onto rank 0, on the CPU (empty
        on the other ranks; a collective: every rank calls it). For the rollout engine and the HF export."""


def check_step(step: Step, dp_group: dist.ProcessGroup | None, device: torch.device) -> None:
    """The step has events, and every replica has the same kinds of events in the same order (else a collective
    would hang): the same number of microbatches under a HARTS plan, empty events padding a carry plan."""
    if not step.events:
        raise ValueError("`step` is empty: every DP replica needs at least one microbatch (or empty event) per step")
    if dp_group is None:
        return
    kinds = "".join(kind[0] for kind, _ in step.events).encode()
    signature = [len(kinds), int.from_bytes(hashlib.sha256(kinds).digest()[:7], "little")]
    both = torch.tensor(signature + [-x for x in signature], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dp_group)
    if not torch.equal(both[:2], -both[2:]):
        raise ValueError(
            f"DP replicas got different sequences of forward and backward events (this rank {len(step)} microbatches, "
            f"{len(kinds)} events): every replica must run the same number of microbatches (plan with the DP degree, "
            "planner K mod D = 0) and the same kinds of events in the same order (carry: pad with empty events, "
            "slot -1)"
        )


def step_metrics(microbatches: Sequence[Microbatch], losses_K: torch.Tensor, extras: dict[str, float],
                 expert_counts: list[torch.Tensor | None], forward_seconds: float,
                 backward_seconds: float) -> StepMetrics:
    """StepMetrics of this replica's microbatches (slot order) from their losses `[K]` (float64)."""
    finite_K = torch.isfinite(losses_K).cpu()
    return StepMetrics(
        loss=float(losses_K.sum()), microbatches=len(microbatches),
        compact_rows=sum(mb.num_compact for mb in microbatches),
        semantic_tokens=sum(mb.num_semantic for mb in microbatches),
        linear_attention_calls=sum(mb.linear_attention_calls for mb in microbatches),
        flat_microbatches=sum(mb.flat for mb in microbatches),
        extras=extras, expert_counts=expert_counts,
        non_finite=None if bool(finite_K.all()) else int((~finite_K).nonzero()[0]),
        forward_seconds=forward_seconds, backward_seconds=backward_seconds,
    )


class StepSums:
    """What a runner sums while it runs a replica's microbatches: each one's loss (by slot), the loss function's
    metrics, the expert counts per layer and the host time in forward and backward."""

    def __init__(self) -> None:
        self.losses: dict[int, torch.Tensor] = {}
        self.extras: dict[str, torch.Tensor] = {}
        self.expert_counts: list[torch.Tensor | None] = []
        self.forward_seconds = 0.0
        self.backward_seconds = 0.0

    def add(self, slot: int, loss: torch.Tensor, metrics: dict[str, torch.Tensor], output: TreeLMOutput) -> None:
        """Microbatch `slot`'s loss, its metrics and its forward's router statistics."""
        self.losses[slot] = loss.detach().to(torch.float64)
        for k, v in metrics.items():
            self.extras[k] = self.extras.get(k, 0.0) + v.detach().to(torch.float64)
        counts = [None if s is None else s.expert_counts for s in output.moe_stats]
        self.expert_counts = counts if not self.expert_counts else [
            None if a is None else a + b for a, b in zip(self.expert_counts, counts)
        ]

    def result(self, microbatches: Sequence[Microbatch]) -> StepMetrics:
        losses = torch.stack([self.losses[k] for k in sorted(self.losses)])
        return step_metrics(microbatches, losses, {k: float(v) for k, v in self.extras.items()}, self.expert_counts,
                            self.forward_seconds, self.backward_seconds)
