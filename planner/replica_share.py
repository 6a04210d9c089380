"""One data-parallel replica's share of a step plan, described the same way whatever the planner mode: what
preparation (`parallel.replica.prepare_step`) builds the replica's step from.

Legend: K microbatches of the replica (one per slot it uses), U units it runs.

A unit is a group of the step's trajectories packed into one trie (`planner.pack.pack`); a part is a range
[start, stop) of a unit's trie rows in preorder; a microbatch executes its parts; the events order the
microbatches' forwards and backwards. Both plans give their share this way (`MicrobatchPlan.replica`,
`CarryPlan.replica`):
- a HARTS plan (duplicate mode, and auto mode's HARTS plan): each microbatch is one unit, its trajectories, whole;
  nothing is carried, so the events are forward k, backward k in slot order (`forward_backward_events`). The plan
  records for each microbatch whether it runs as its flat expansion instead of its trie (auto mode's choice,
  `planner.microbatch.flat`);
- a carry plan: the units are the replica's trees, cut into parts that read their context from earlier
  microbatches, and the events are the planner's (`planner.carry.events`; slot -1: an empty event).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "ReplicaShare", "check_replica", "forward_backward_events"]

Event = tuple[str, int]
"""("forward" | "backward", slot among the replica's microbatches); slot -1 is an empty event (a replica with nothing
to run at that point under data parallelism)."""


@dataclass(frozen=True)
class ReplicaShare:
    """What one replica runs of a step plan (see the module docstring)."""

    units: tuple[tuple[int, ...], ...]
    """[U] the trajectory indices (into the step's trajectories, ascending) of each unit its parts name."""
    parts: tuple[tuple[tuple[int, int, int], ...], ...]
    """[K] per microbatch in slot order, its parts (unit, start, stop): rows [start, stop) of that unit's trie."""
    events: tuple[Event, ...]
    """Its forward and backward events in order."""
    carries: bool
    """Whether parts read context from earlier microbatches (prefix carry: each microbatch's rows are laid out
    around its links, `models.carry_microbatch`); False: each microbatch is one whole unit, self-contained."""
    flat: tuple[bool, ...]
    """[K] whether each microbatch runs as its flat expansion (trajectory-wise, nothing shared) instead of its trie
    (never under carry)."""


def check_replica(dp_rank: int, dp: int) -> None:
    """Refuse a replica index outside a plan made for `dp` replicas."""
    if not 0 <= dp_rank < dp:
        raise ValueError(f"`dp_rank` {dp_rank} is outside the plan's {dp} replicas: plan with the job's DP degree")


def forward_backward_events(slots: int) -> tuple[Event, ...]:
    """Forward k, backward k for k = 0 .. slots - 1: the events of microbatches that carry nothing."""
    return tuple((kind, k) for k in range(slots) for kind in ("forward", "backward"))
