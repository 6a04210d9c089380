"""Which microbatches of a HARTS plan run as their flat expansion (auto mode, `planner.step_plan`), decided from
the plan's numbers before anything is packed: preparation then packs each microbatch once, as its trie or flat.

Legend: N trajectories of a microbatch.

`CostModel.runs_flat` compares a microbatch's trie (its compact rows, the plan's work, and the rows of its
full-attention branch views) with its flat expansion (one row per token), which must fit the capacity. The view rows
need no linear-attention plan: with replay every input sequence of a trie's plan ends at a leaf and every leaf ends
one (`planner.calls.plan`), and a sequence's view is the path from the root through its last row, so the view rows
are the lengths of the trie's leaf paths summed (`leaf_rows`), whatever the chunk size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from planner.cost_model import CostModel
from planner.lcp_index import lexicographic_lcp
from planner.microbatch.plan import MicrobatchPlan
from planner.trajectory import Trajectory

__all__ = ["leaf_rows", "with_flat_choices"]


def leaf_rows(trajectories: Sequence[Trajectory]) -> int:
    """Summed lengths of the trie's leaf paths: of the trajectories that are no proper prefix of another, each
    distinct path once. In lexicographic order a trajectory is a leaf path unless it is a prefix of the next one."""
    order, lcp = lexicographic_lcp([t.tokens for t in trajectories], byteorder="=")
    lengths = np.fromiter((len(trajectories[i]) for i in order), dtype=np.int64, count=order.size)  # [N]
    shared_with_next = np.append(lcp[1:], 0)  # [N]
    return int(lengths[shared_with_next < lengths].sum())


def with_flat_choices(plan: MicrobatchPlan, trajectories: Sequence[Trajectory], cost: CostModel) -> MicrobatchPlan:
    """`plan` with each microbatch marked flat where `cost` predicts its flat expansion faster than its trie and the
    expansion fits the plan's capacity (`CostModel.runs_flat`)."""
    microbatches = []
    for mb in plan.microbatches:
        group = [trajectories[i] for i in mb.trajectories]
        tokens = sum(len(t) for t in group)
        flat = cost.runs_flat(mb.compact_tokens, leaf_rows(group), tokens, plan.capacity)
        microbatches.append(dataclasses.replace(mb, flat=flat))
    return dataclasses.replace(plan, microbatches=tuple(microbatches))
