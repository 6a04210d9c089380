"""Carry microbatches: a step's trees cut into parts, the parts grouped into microbatches, each prepared once
(`models.microbatch.Microbatch`) with its layout, its links to the others and its loss inputs, plus the replica's
order of forward and backward events (`models.step.Step`).

Legend: S scored semantic positions of a microbatch, C its own compact rows.

Every tree (one connected component of the step's trie) is packed alone (`planner.pack.pack` of its trajectories); its
parts are ranges of that trie's preorder rows (`models.tree.carry_microbatch_layout`), so every unique row runs once in
the whole step. A microbatch scores the positions whose logit rows it holds; each position's loss inputs are those of
its tree under the step's normalisers (`models.microbatch.LossInputs`, so a trajectory split over microbatches is
averaged over all of its positions). MoE statistics weight each own row by its multiplicity in the tree, and a
microbatch's token share is its rows' multiplicity sum over the step's positions, so the router z-loss summed over the
step equals the trajectory-wise one; the load-balancing loss stays a per-microbatch quantity, as without carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.config import ModelConfig
from models.microbatch import Aggregation, LossInputs, Microbatch, StepNormalizer
from models.step import Event, Step, check_events
from models.tree.carry_microbatch_layout import CarryLayout, Part, carry_layouts
from planner.pack import CompactBatch, pack
from planner.trajectory import Trajectory

__all__ = ["prepare_carry_step"]


def _loss_inputs(tree_inputs: dict[int, LossInputs], parts: Sequence[Part], scored: Sequence[np.ndarray],
                 token_share: float) -> LossInputs:
    """The scored positions' entries of their trees' loss inputs, part after part."""
    def take(name: str) -> torch.Tensor | None:
        values = [getattr(tree_inputs[p.tree], name) for p in parts]
        if any(v is None for v in values):
            return None
        return torch.cat([v[torch.as_tensor(s, device=v.device)] for v, s in zip(values, scored)])

    return LossInputs(token_weight=take("token_weight"), trained=take("trained"), token_share=token_share,
                      advantage=take("advantage"), rollout_logprobs=take("rollout_logprobs"),
                      ref_logprobs=take("ref_logprobs"))


def prepare_carry_step(
    trees: Sequence[Sequence[Trajectory]],
    microbatches: Sequence[Sequence[tuple[int, int, int]]],
    model: ModelConfig,
    device: torch.device,
    *,
    events: Sequence[Event] | None = None,
    normalizer: StepNormalizer | None = None,
    aggregation: Aggregation = "token-mean",
) -> Step:
    """A replica's step of carry microbatches (every one with links, maybe empty) and their events.

    Args:
        trees: the trajectories of each tree of the step (a tree is one connected component of the step's trie;
            only the trees the parts name are packed).
        microbatches: in slot order, each microbatch's parts (tree, start, stop): rows of `pack(trees[tree])` in
            preorder. The parts of a tree cover its rows once, all on this replica.
        model: the config of the model that will run them (chunk size, conv width, which layer kinds).
        device: where the layouts and loss inputs live.
        events: this replica's ("forward" | "backward", slot) events (slot -1: empty); default: every forward in
            slot order, then every backward in reverse.
        normalizer, aggregation: the step's global counts and the loss aggregation (`models.microbatch`); without a
            normalizer the microbatches carry no loss inputs (scoring).
    """
    parts = [tuple(Part(*map(int, p)) for p in mb) for mb in microbatches]
    if any(not mb for mb in parts):
        raise ValueError("every carry microbatch needs at least one part, got an empty one")
    used = sorted({p.tree for mb in parts for p in mb})
    bad = [t for t in used if not 0 <= t < len(trees)]
    if bad:
        raise ValueError(f"parts name trees {bad}, but the step has {len(trees)} trees")
    batches = {t: pack(trees[t]) for t in used}
    built = carry_layouts(batches, parts, model.chunk_size, model.conv_size,
                          "full_attention" in model.layer_types, "linear_attention" in model.layer_types, device)
    tree_inputs = {} if normalizer is None else {
        t: LossInputs.build(b, normalizer, aggregation, device) for t, b in batches.items()
    }
    out = []
    for c in built:
        loss = None
        if normalizer is not None:
            tokens = float(c.layout.row_weight.sum())
            loss = _loss_inputs(tree_inputs, c.parts, c.scored, tokens / max(normalizer.semantic_tokens, 1.0))
        out.append(_microbatch(c, batches, loss))
    if events is None:
        events = [("forward", m) for m in range(len(out))] + [("backward", m) for m in reversed(range(len(out)))]
    events = check_events(events, len(out))
    null = None
    if any(slot < 0 for _, slot in events):
        dummy = {0: pack([Trajectory(np.ones(2, dtype=np.int64))])}
        (c,) = carry_layouts(dummy, [[Part(0, 0, 2)]], model.chunk_size, model.conv_size, False, False, device)
        null = _microbatch(c, dummy, None)
    return Step(out, events, null)


def _microbatch(c: CarryLayout, batches: dict[int, CompactBatch], loss: LossInputs | None) -> Microbatch:
    return Microbatch(c.parts, tuple(batches[p.tree] for p in c.parts), tuple(c.scored), c.call_plan, c.layout, loss,
                      c.links)
