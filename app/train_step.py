"""One optimizer step of tree training in one process: microbatch plan -> compact execution -> mapped log-probs ->
loss -> backward (gradient accumulation) -> clipped AdamW step.

Legend: S semantic positions of a microbatch (original order), C compact rows, E experts.

`prepare_microbatches` runs the planners once per step: plan_microbatches (HARTS §3.2) -> pack -> plan_calls ->
TreeLayout, and attaches the per-position metadata and loss weights. The weights are normalised over the WHOLE
step (`parallel.step.step_normalizer` / `token_weights`), so the microbatch losses add up to the step loss and the
accumulated gradient equals that of one batch. Layouts are reused by every pass over the step (old and reference
log-probs, several epochs). `forward_backward` is the part a distributed driver replaces
(`parallel.step.train_step` runs the same loop on each replica's microbatches).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from models.decoder import DecoderOutput, HybridForCausalLM
from models.logprobs import compact_logprobs
from models.moe import MoEStats
from models.tree.attention import Backend
from models.tree.execute import tree_hidden_states
from models.tree.layout import TreeLayout
from parallel.step import replica_microbatches, step_normalizer, token_weights
from planner.calls import plan_calls
from planner.microbatch import plan_microbatches
from planner.pack import CompactBatch, pack
from planner.trajectory import Trajectory

__all__ = ["Microbatch", "StepPlan", "StepResult", "prepare_microbatches", "forward_backward", "score",
           "optimizer_step", "pooled_moe_stats"]


@dataclass(eq=False)
class Microbatch:
    """One planned microbatch on the trainer device. Per-position tensors are [S], original order."""

    batch: CompactBatch
    layout: TreeLayout
    token_weight: torch.Tensor
    """[S] float64 loss weight: step-global normaliser x trajectory weight, 0 on untrained positions."""
    trained: torch.Tensor
    """[S] bool: positions the loss trains (loss_mask without first tokens)."""
    token_share: float
    """This microbatch's semantic positions / those of the step (weights per-microbatch MoE aux losses)."""
    advantage: torch.Tensor
    """[S] float64."""
    rollout_logprobs: torch.Tensor | None = None
    """[S] behaviour log-probs from the rollout engine (0 where the engine sampled nothing), or None."""
    old_logprobs: torch.Tensor | None = None
    """[S] the trainer's log-probs before this step's first update (set by the caller when rl.epochs > 1)."""
    ref_logprobs: torch.Tensor | None = None
    """[S] reference-policy log-probs (set by the caller when a KL term is on)."""
    num_rounds: int = 0
    """Packed linear-attention calls per layer (rounds of the call plan)."""


@dataclass
class StepPlan:
    """The step's microbatches and what planning them cost."""

    microbatches: list[Microbatch]
    planner_seconds: float
    compact_tokens: int
    semantic_tokens: int


@dataclass
class StepResult:
    """Sums over the microbatches of one forward/backward pass."""

    finite: bool
    """False if a microbatch loss was NaN/inf (then the pass stopped there and gradients must be discarded)."""
    bad_microbatch: int | None = None
    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss function's metric sums."""
    expert_counts: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer: multiplicity-weighted expert assignment counts [E] (None for dense layers)."""
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0


#: loss_fn(microbatch, logprobs_S, entropy_S, output) -> (loss already divided by step-global normalisers,
#: {name: detached metric sum}).
MicrobatchLoss = Callable[[Microbatch, torch.Tensor, torch.Tensor, DecoderOutput],
                          tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _optional(values: np.ndarray | None, device) -> torch.Tensor | None:
    if values is None:
        return None
    return torch.as_tensor(np.nan_to_num(values, nan=0.0), dtype=torch.float64, device=device)


def prepare_microbatches(
    trajectories: Sequence[Trajectory],
    *,
    capacity: int,
    chunk_size: int,
    conv_size: int,
    aggregation: Literal["token-mean", "seq-mean-token-mean"],
    device: torch.device,
) -> StepPlan:
    """Plan the step's trajectories into microbatches (one DP replica) and build their tree layouts."""
    start = time.perf_counter()
    plan = plan_microbatches(trajectories, capacity, 1)
    groups = replica_microbatches(plan, trajectories, 0)
    normalizer = step_normalizer(groups)
    total = sum(len(t) for t in trajectories)
    microbatches = []
    for group in groups:
        batch = pack(group)
        calls = plan_calls(batch, chunk_size)
        trained = batch.loss_mask.copy()
        microbatches.append(
            Microbatch(
                batch=batch,
                layout=TreeLayout.build(batch, calls, conv_size, device),
                token_weight=torch.as_tensor(token_weights(batch, normalizer, aggregation), device=device),
                trained=torch.as_tensor(trained, device=device),
                token_share=batch.num_semantic / total,
                advantage=torch.as_tensor(batch.advantage, dtype=torch.float64, device=device),
                rollout_logprobs=_optional(batch.logprobs, device),
                ref_logprobs=_optional(batch.ref_logprobs, device),
                num_rounds=calls.num_rounds,
            )
        )
    return StepPlan(
        microbatches=microbatches,
        planner_seconds=time.perf_counter() - start,
        compact_tokens=sum(mb.batch.num_compact for mb in microbatches),
        semantic_tokens=sum(mb.batch.num_semantic for mb in microbatches),
    )


def _logprobs(model: HybridForCausalLM, mb: Microbatch, temperature: float, entropy: bool, backend: Backend):
    """Tree execution + compact log-probs of the tempered distribution softmax(logits / temperature), which is
    what the rollout engine sampled from (vLLM "processed_logprobs")."""
    out = tree_hidden_states(model, mb.layout, backend)
    weight_VD = model.lm_head_weight if temperature == 1.0 else model.lm_head_weight / temperature
    result = compact_logprobs(out.hidden, weight_VD, mb.layout.logit_row, mb.layout.target, entropy=entropy)
    return result, out


def forward_backward(
    model: HybridForCausalLM, microbatches: Sequence[Microbatch], loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
    attention_backend: Backend = "dense",
) -> StepResult:
    """Forward, loss and backward of every microbatch in order; gradients accumulate in the parameters.

    `attention_backend` is the tree full-attention backend (models.tree.attention: "dense" is the O(C^2) CPU
    reference, "flex" / "branch" for GPUs). Stops at the first non-finite microbatch loss (result.finite False): the
    caller must then drop the gradients.
    """
    result = StepResult(finite=True)
    sums: dict[str, torch.Tensor] = {}
    for i, mb in enumerate(microbatches):
        start = time.perf_counter()
        (logprobs_S, entropy_S), output = _logprobs(model, mb, temperature, True, attention_backend)
        loss, metrics = loss_fn(mb, logprobs_S, entropy_S, output)
        middle = time.perf_counter()
        if not torch.isfinite(loss):
            result.finite, result.bad_microbatch = False, i
            result.forward_seconds += middle - start
            return result
        loss.backward()
        result.forward_seconds += middle - start
        result.backward_seconds += time.perf_counter() - middle
        result.loss += float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.detach().to(torch.float64)
        counts = [None if s is None else s.expert_counts for s in output.moe_stats]
        result.expert_counts = counts if not result.expert_counts else [
            None if a is None else a + b for a, b in zip(result.expert_counts, counts)
        ]
    result.metrics = {k: float(v) for k, v in sums.items()}
    return result


@torch.no_grad()
def score(
    model: HybridForCausalLM, microbatches: Sequence[Microbatch], *, temperature: float = 1.0,
    attention_backend: Backend = "dense",
) -> list[torch.Tensor]:
    """[S] float64 log-probs of every microbatch under `model` (no graph): old or reference log-probs."""
    out = []
    for mb in microbatches:
        logprobs_S, _ = _logprobs(model, mb, temperature, False, attention_backend)
        out.append(logprobs_S.to(torch.float64))
    return out


def optimizer_step(
    model: HybridForCausalLM, optimizer: torch.optim.Optimizer, grad_clip: float
) -> tuple[float, bool]:
    """Clip the global gradient norm and step; a non-finite norm skips the update. Returns (norm, stepped).
    Gradients are zeroed either way."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
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
