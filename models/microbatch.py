"""Microbatches: the one microbatch type every runner executes, HARTS microbatch preparation (trajectories -> trie
-> call plan -> TreeLayout), and the loss inputs.

Legend: S semantic positions of a microbatch (original order), C compact rows.

A `Microbatch` executes parts of packed tries (`parts`, `batches`), holds the device tensors every layer reads
(`layout`), the per-position tensors of its loss (`loss`, so a loss reads its inputs from the microbatch it is
handed) and, under prefix carry, its links to the step's other microbatches (`links`). `prepare_microbatch` makes
a HARTS one: pack the trajectories once (`planner.pack`; as their trie, or as their flat expansion where the plan
says so), plan the linear-attention calls with the model's chunk size (`planner.calls.plan`) and build the layout
(`models.tree.layout.TreeLayout`); the trainer's ranks reach it through `parallel.replica.prepare_step`, the
benchmarks and tests directly. Carry microbatches come from `models.carry_microbatch`.

Loss weights: the loss of a microbatch must already be divided by the normalisers of the WHOLE step (all
microbatches of all replicas), so that the step loss is the sum of the microbatch losses and its gradient is the
single-process gradient of the whole step (`token_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from models.config import ModelConfig
from models.tree.carry_microbatch_layout import CarryLinks, Part
from models.tree.layout import TreeLayout
from planner.calls.plan import ExecutionPlan, plan_calls
from planner.pack import CompactBatch, pack
from planner.trajectory import Trajectory

__all__ = ["Aggregation", "StepNormalizer", "LossInputs", "Microbatch", "trained_counts", "token_weights",
           "prepare_microbatch"]

Aggregation = Literal["token-mean", "seq-mean-token-mean"]


@dataclass(frozen=True)
class StepNormalizer:
    """Global counts of one optimizer step, equal on every rank."""

    trained_tokens: float
    """Positions with loss_mask (first tokens excluded) over all trajectories of the step."""
    trained_trajectories: float
    """Trajectories with at least one trained position."""
    semantic_tokens: float
    """All positions of the step (weights per-microbatch MoE aux losses by the microbatch's share)."""


def trained_counts(trajectories: Sequence[Trajectory]) -> tuple[int, int, int]:
    """(trained positions, trajectories with a trained position, all positions) of `trajectories`: summed over the
    step they are a `StepNormalizer`."""
    trained = [int(np.count_nonzero(t.loss_mask[1:])) for t in trajectories]
    return sum(trained), sum(n > 0 for n in trained), sum(len(t) for t in trajectories)


def token_weights(batch: CompactBatch, normalizer: StepNormalizer, aggregation: Aggregation) -> np.ndarray:
    """Per-position loss weights `[S]` (float64) of one microbatch under the step's global normalisers, times the
    trajectory weights: "token-mean" = 1 / trained_tokens; "seq-mean-token-mean" = 1 / (trained positions of the
    trajectory * trained_trajectories). Zero on untrained positions. Summed over all microbatches of the step, the
    weighted losses are the configured aggregation over the whole step."""
    mask = batch.loss_mask.astype(np.float64)
    if aggregation == "token-mean":
        w = mask / max(normalizer.trained_tokens, 1.0)
    elif aggregation == "seq-mean-token-mean":
        per_traj = np.bincount(batch.traj_index, weights=mask, minlength=batch.num_trajectories)
        w = mask / np.maximum(per_traj[batch.traj_index], 1.0) / max(normalizer.trained_trajectories, 1.0)
    else:
        raise ValueError(f"`aggregation` must be 'token-mean' or 'seq-mean-token-mean', got {aggregation!r}")
    return w * batch.weight


@dataclass(eq=False)
class LossInputs:
    """What the losses read of one microbatch besides its log-probs, on the trainer device. Tensors are `[S]`."""

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
    """The trainer's log-probs before this step's first update (set by the job when rl.epochs > 1)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-policy log-probs (from the trajectories, or set by the job when a KL term is on)."""

    @staticmethod
    def build(batch: CompactBatch, normalizer: StepNormalizer, aggregation: Aggregation,
              device: torch.device) -> "LossInputs":
        def optional(values: np.ndarray | None) -> torch.Tensor | None:
            if values is None:
                return None
            return torch.as_tensor(np.nan_to_num(values, nan=0.0), dtype=torch.float64, device=device)

        return LossInputs(
            token_weight=torch.as_tensor(token_weights(batch, normalizer, aggregation), device=device),
            trained=torch.as_tensor(batch.loss_mask, device=device),
            token_share=batch.num_semantic / max(normalizer.semantic_tokens, 1.0),
            advantage=torch.as_tensor(batch.advantage, dtype=torch.float64, device=device),
            rollout_logprobs=optional(batch.logprobs),
            ref_logprobs=optional(batch.ref_logprobs),
        )


@dataclass(eq=False)
class Microbatch:
    """One microbatch of a step on the trainer device, whatever the planner mode.

    A HARTS microbatch (`prepare_microbatch`) is one part, all rows of the trie of its trajectories (or of their
    flat expansion), scores every position of it and has no links: it runs on its own, forward then backward. A carry
    microbatch (`models.carry_microbatch`) holds ranges of trees' tries, scores the positions whose logit rows it
    holds, and reads context from earlier microbatches through its links.
    """

    parts: tuple[Part, ...]
    """Its parts: the unit (`Part.tree`: a tree of a carry step, 0 for a HARTS microbatch's own trajectories) and
    the rows [start, stop) of the unit's trie in preorder."""
    batches: tuple[CompactBatch, ...]
    """Per part: its unit packed (`planner.pack.pack`; per-position metadata in original order)."""
    scored: tuple[np.ndarray, ...]
    """Per part: the positions of its unit's semantic arrays scored here (ascending); log-probs come in this order."""
    call_plan: ExecutionPlan
    """Its minimum-call plan (physical row order, rounds, replay; numpy)."""
    layout: TreeLayout
    """What every layer of tree execution reads (device tensors, physical row order)."""
    loss: LossInputs | None = None
    """The loss inputs `[S]` under the step's normalisers; None when prepared without them (scoring, benchmarks)."""
    links: CarryLinks | None = None
    """What it imports from earlier microbatches and exports to later ones (prefix carry: its layout is laid out
    around them, and it runs under a `models.tree.carry_exchange.CarryContext`); None for a HARTS microbatch, which
    runs under a plain `models.tree.mixers.TreeContext`."""
    flat: bool = False
    """Run as its flat expansion (`planner.pack.pack(share=False)`: trajectory-wise, nothing shared), as the plan
    said (`planner.microbatch.flat`) or the caller asked."""

    @property
    def num_compact(self) -> int:
        """Compact rows the microbatch executes."""
        return sum(p.stop - p.start for p in self.parts)

    @property
    def num_semantic(self) -> int:
        """Semantic positions it scores."""
        return sum(int(s.size) for s in self.scored)

    @property
    def linear_attention_calls(self) -> int:
        """Packed linear-attention kernel calls per layer (the plan's rounds, split where a round exports states
        from inside a sequence: `models.tree.core_calls`)."""
        return self.layout.linear_attention_calls


def prepare_microbatch(
    trajectories: Sequence[Trajectory],
    model: ModelConfig,
    device: torch.device,
    *,
    normalizer: StepNormalizer | None = None,
    aggregation: Aggregation = "token-mean",
    replay: bool = True,
    flat: bool = False,
) -> Microbatch:
    """Pack `trajectories` once, into a trie or (`flat`) their flat expansion, plan its tree execution with the
    model's chunk size and conv width, and (with the step's `normalizer`) build its loss inputs. Trie and flat
    expansion give the same log-probs, losses and gradients.

    Args:
        trajectories: the microbatch's trajectories (any order; the trie is built in lexicographic order).
        model: the config of the model that will run it (chunk size B and conv width W).
        device: where the layout and loss tensors live.
        normalizer: the step's global counts (sum of `trained_counts` over every microbatch of every replica).
        aggregation: how `token_weights` averages the loss.
        replay: linear-attention replay of [a(p), p) for forks inside chunks (HARTS); False only for the ablation.
        flat: run the flat expansion (the plan's choice in auto mode, `PlannedMicrobatch.flat`; benchmarks).
    """
    batch = pack(trajectories, share=not flat)
    plan = plan_calls(batch, model.chunk_size, replay=replay)
    layout = TreeLayout.build(batch, plan, model.conv_size, device)
    loss = None if normalizer is None else LossInputs.build(batch, normalizer, aggregation, device)
    return Microbatch((Part(0, 0, batch.num_compact),), (batch,), (np.arange(batch.num_semantic),), plan, layout,
                      loss, flat=flat)
