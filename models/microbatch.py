"""Microbatch preparation, the one home: trajectories -> trie -> call plan -> TreeLayout, plus the loss inputs.

Legend: S semantic positions of a microbatch (original order), C compact rows.

`prepare_microbatch` is what every caller uses (the trainer's ranks through `parallel.replica`, the benchmarks,
the tests): pack the trajectories (`planner.pack`), plan the linear-attention calls with the model's chunk size
(`planner.calls.plan`), build the device tensors every layer reads (`models.tree.layout.TreeLayout`) and, when the
step's normalisers are given, the per-position tensors of the loss (`LossInputs`). A `Microbatch` carries all of
them, so a loss reads its inputs from the microbatch it is handed.

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
from models.tree.layout import TreeLayout
from planner.calls.plan import ExecutionPlan, plan_calls
from planner.cost_model import CostModel
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
    """One microbatch packed for tree execution on the trainer device."""

    batch: CompactBatch
    """The trie of the microbatch's trajectories and their per-position metadata (numpy, original order)."""
    call_plan: ExecutionPlan
    """Its minimum-call plan (physical row order, rounds, replay; numpy)."""
    layout: TreeLayout
    """What every layer of tree execution reads (device tensors, physical row order)."""
    loss: LossInputs | None = None
    """The loss inputs under the step's normalisers; None when prepared without them (scoring, benchmarks)."""
    flat: bool = False
    """Run as its flat expansion (`planner.pack.pack(share=False)`: trajectory-wise, nothing shared), because the
    cost model predicted the trie slower (`prepare_microbatch`'s `cost`) or the caller asked for it."""

    @property
    def num_compact(self) -> int:
        """Compact rows the microbatch executes."""
        return self.batch.num_compact

    @property
    def num_semantic(self) -> int:
        """Semantic positions it scores."""
        return self.batch.num_semantic

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
    cost: CostModel | None = None,
    capacity: int | None = None,
    share: bool = True,
) -> Microbatch:
    """Pack `trajectories` into a trie, plan its tree execution with the model's chunk size and conv width, and
    (with the step's `normalizer`) build its loss inputs. With a `cost` model and the microbatch `capacity`, a trie
    it predicts slower than its flat expansion, when that expansion fits the capacity (`CostModel.runs_flat` of its
    rows, view rows and semantic tokens), is packed unshared instead: the same log-probs, losses and gradients,
    trajectory-wise.

    Args:
        trajectories: the microbatch's trajectories (any order; the trie is built in lexicographic order).
        model: the config of the model that will run it (chunk size B and conv width W).
        device: where the layout and loss tensors live.
        normalizer: the step's global counts (sum of `trained_counts` over every microbatch of every replica).
        aggregation: how `token_weights` averages the loss.
        replay: linear-attention replay of [a(p), p) for forks inside chunks (HARTS); False only for the ablation.
        cost, capacity: decide tree or flat execution (both or neither); None: the trie.
        share: False runs the flat expansion whatever `cost` says (benchmarks timing it).
    """
    if (cost is None) != (capacity is None):
        raise ValueError("prepare_microbatch: give `cost` and `capacity` together (the flat expansion must fit)")
    batch = pack(trajectories, share=share)
    plan = plan_calls(batch, model.chunk_size, replay=replay)
    flat = not share or cost is not None and cost.runs_flat(batch.num_compact, plan.view_rows(batch.positions),
                                                            batch.num_semantic, capacity)
    if flat and share:
        batch = pack(trajectories, share=False)
        plan = plan_calls(batch, model.chunk_size, replay=replay)
    layout = TreeLayout.build(batch, plan, model.conv_size, device)
    loss = None if normalizer is None else LossInputs.build(batch, normalizer, aggregation, device)
    return Microbatch(batch, plan, layout, loss, flat)
