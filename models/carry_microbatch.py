"""Carry microbatches (issue #17), the prefix-carry counterpart of `models.microbatch`: a step's trees cut into
parts, the parts grouped into microbatches, each prepared once with its layout, its links to the others and its loss
inputs, plus the replica's order of forward and backward events.

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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.config import ModelConfig
from models.microbatch import Aggregation, LossInputs, StepNormalizer
from models.tree.carry_microbatch_layout import CarryLayout, Part, carry_layouts
from planner.pack import pack
from planner.trajectory import Trajectory

__all__ = ["Event", "CarryMicrobatch", "CarryStep", "prepare_carry_step"]

Event = tuple[str, int]
"""("forward" | "backward", slot); slot -1 is an empty event (a replica with nothing to run at that point)."""


@dataclass(eq=False)
class CarryMicrobatch(CarryLayout):
    """One carry microbatch on the trainer device (the `models.microbatch.Microbatch` of prefix carry): what it
    executes and its loss inputs."""

    loss: LossInputs | None = None
    """Loss inputs `[S]` under the step's normalisers; None when prepared without them."""


@dataclass(eq=False)
class CarryStep:
    """A replica's carry microbatches in slot order and the order of their forward and backward events; iterates
    over the microbatches (as a list of `Microbatch` does)."""

    microbatches: list[CarryMicrobatch]
    events: tuple[Event, ...]
    null: CarryMicrobatch | None = None
    """What an empty event runs under data parallelism (when the events hold one): a two-row microbatch that
    links to nothing, whose forward and backward issue the collectives a real one does (FSDP2 / EP line up)."""

    def __len__(self) -> int:
        return len(self.microbatches)

    def __iter__(self) -> Iterator[CarryMicrobatch]:
        return iter(self.microbatches)

    def __getitem__(self, slot: int) -> CarryMicrobatch:
        return self.microbatches[slot]


def _part(p) -> Part:
    """A `Part` from anything with tree/start/stop (the planner's CarryPart) or a (tree, start, stop) tuple."""
    if isinstance(p, tuple):
        return Part(*map(int, p))
    return Part(int(p.tree), int(p.start), int(p.stop))


def _check_events(events: Sequence[Event], slots: int) -> tuple[Event, ...]:
    seen = {"forward": [], "backward": []}
    for kind, slot in events:
        if kind not in seen or not -1 <= slot < slots:
            raise ValueError(f"event ({kind!r}, {slot}) must be ('forward' | 'backward', slot in [-1, {slots}))")
        if slot >= 0:
            seen[kind].append(slot)
    for kind, got in seen.items():
        if sorted(got) != list(range(slots)):
            raise ValueError(f"the events must hold one {kind!r} per microbatch 0..{slots - 1}, got slots {got}")
    return tuple((kind, int(slot)) for kind, slot in events)


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
    microbatches: Sequence[Sequence],
    model: ModelConfig,
    device: torch.device,
    *,
    events: Sequence[Event] | None = None,
    normalizer: StepNormalizer | None = None,
    aggregation: Aggregation = "token-mean",
) -> CarryStep:
    """Prepare a replica's carry microbatches.

    Args:
        trees: the trajectories of each tree of the step (a tree is one connected component of the step's trie;
            only the trees the parts name are packed).
        microbatches: in slot order, each microbatch's parts: the planner's CarryPart (tree, start, stop) or
            (tree, start, stop) tuples, rows of `pack(trees[tree])` in preorder. The parts of a tree cover its rows
            once, all on this replica.
        model: the config of the model that will run them (chunk size, conv width, which layer kinds).
        device: where the layouts and loss inputs live.
        events: this replica's ("forward" | "backward", slot) events (slot -1: empty); default: every forward in
            slot order, then every backward in reverse.
        normalizer, aggregation: the step's global counts and the loss aggregation (`models.microbatch`); without a
            normalizer the microbatches carry no loss inputs (scoring).
    """
    parts = [tuple(_part(p) for p in mb) for mb in microbatches]
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
        out.append(CarryMicrobatch(c.parts, c.layout, c.links, c.call_plan, c.scored, c.num_compact, loss))
    if events is None:
        events = [("forward", m) for m in range(len(out))] + [("backward", m) for m in reversed(range(len(out)))]
    events = _check_events(events, len(out))
    null = None
    if any(slot < 0 for _, slot in events):
        (c,) = carry_layouts({0: pack([Trajectory(np.ones(2, dtype=np.int64))])}, [[Part(0, 0, 2)]],
                             model.chunk_size, model.conv_size, False, False, device)
        null = CarryMicrobatch(c.parts, c.layout, c.links, c.call_plan, c.scored, c.num_compact)
    return CarryStep(out, events, null)
