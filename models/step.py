"""A replica's step as every runner takes it: its microbatches in slot order and the order of their forward and
backward events.

Legend: K microbatches of the replica.

One type for every planner mode. A HARTS step (duplicate mode, or auto mode's HARTS plan) is a carry step without
carried context: each microbatch runs on its own (no `Microbatch.links`) and the events are forward k, backward k
for k = 0 .. K-1 (`Step.self_contained`). A prefix-carry step (`models.carry_microbatch.prepare_carry_step`) has
microbatches that read and export context, in the planner's event order; slot -1 is an empty event (under data
parallelism, a replica with nothing to run at that point), which runs `null`. `parallel.replica.prepare_step`
builds either from the replica's share of the step plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from models.microbatch import Microbatch
from planner.replica_share import Event, forward_backward_events

__all__ = ["Event", "Step", "check_events"]


@dataclass(eq=False)
class Step:
    """A replica's microbatches in slot order and its events; iterates over the microbatches."""

    microbatches: list[Microbatch]
    events: tuple[Event, ...]
    null: Microbatch | None = None
    """What an empty event runs under data parallelism (when the events hold one): a two-row microbatch that
    links to nothing, whose forward and backward issue the collectives a real one does (FSDP2 / EP line up)."""

    @staticmethod
    def self_contained(microbatches: Sequence[Microbatch]) -> "Step":
        """The step of microbatches that carry nothing (HARTS): each forward then backward, in slot order."""
        return Step(list(microbatches), forward_backward_events(len(microbatches)))

    @property
    def carries(self) -> bool:
        """Whether some microbatch has links (prefix carry: its layout and its context read carried rows)."""
        return any(mb.links is not None for mb in self.microbatches)

    def __len__(self) -> int:
        return len(self.microbatches)

    def __iter__(self) -> Iterator[Microbatch]:
        return iter(self.microbatches)

    def __getitem__(self, slot: int) -> Microbatch:
        return self.microbatches[slot]


def check_events(events: Sequence[Event], slots: int) -> tuple[Event, ...]:
    """`events` as a tuple, refused unless they are ("forward" | "backward", slot in [-1, slots)) with one forward and
    one backward of every microbatch 0 .. slots - 1."""
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
