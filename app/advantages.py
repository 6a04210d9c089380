"""Advantages written onto the trajectories' per-token `advantage`: group-relative for rollout trees (GRPO), or a
batch-mean baseline (PPO without a critic).

Two groupings:
- "tree": each trajectory's reward minus the mean reward of its tree, divided by the tree's reward std (GRPO with a
  tree as the group); every token of the trajectory gets that value.
- "siblings": a token's advantage is V(row) - V(parent row), where V(row) is the mean reward of the trajectories whose
  path contains that row. Along a fork-free path V is constant, so the advantage is zero there and jumps at forks:
  each branch is compared with its siblings under the same prefix. Divided by the tree's reward std as well.
`assign_batch_baseline` subtracts the mean reward of the whole step instead. Only trained (loss-masked) tokens use
the result; it is written for every token.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal, Sequence

import numpy as np

from planner.pack import pack
from planner.trajectory import Trajectory

__all__ = ["assign_advantages", "assign_batch_baseline"]


def _row_values(batch, rewards: np.ndarray) -> np.ndarray:
    """V[c] = mean reward of trajectories whose last row lies in the subtree of row c (preorder ranges)."""
    ends = batch.sem_to_compact[batch.traj_offsets[1:] - 1]
    order = np.argsort(ends, kind="stable")
    sorted_ends = ends[order]
    csum = np.concatenate([[0.0], np.cumsum(rewards[order])])
    rows = np.arange(batch.num_compact)
    lo = np.searchsorted(sorted_ends, rows, side="left")
    hi = np.searchsorted(sorted_ends, batch.subtree_end, side="left")
    return (csum[hi] - csum[lo]) / np.maximum(hi - lo, 1)


def assign_advantages(
    trajectories: Sequence[Trajectory], grouping: Literal["tree", "siblings"] = "tree", scale_by_std: bool = True,
    eps: float = 1e-6,
) -> None:
    """Set `advantage` of every trajectory from the rewards of its tree (trajectories with equal `tree` ids)."""
    groups: dict = defaultdict(list)
    for i, t in enumerate(trajectories):
        if t.reward is None:
            raise ValueError(f"trajectory {i} (tree {t.tree!r}) has no reward: advantages need one per trajectory")
        groups[t.tree].append(i)
    for members in groups.values():
        rewards = np.array([trajectories[i].reward for i in members], dtype=np.float64)
        std = rewards.std() if scale_by_std else 1.0
        denom = std + eps if scale_by_std else 1.0
        if grouping == "tree":
            for i, r in zip(members, rewards):
                t = trajectories[i]
                t.advantage = np.full(len(t), (r - rewards.mean()) / denom)
        elif grouping == "siblings":
            batch = pack([trajectories[i] for i in members])
            value = _row_values(batch, rewards)
            parent_value = np.where(batch.parent >= 0, value[np.maximum(batch.parent, 0)], value)
            step = (value - parent_value) / denom
            for j, i in enumerate(members):
                rows = batch.sem_to_compact[batch.traj_offsets[j] : batch.traj_offsets[j + 1]]
                trajectories[i].advantage = step[rows].copy()
        else:
            raise ValueError(f"`grouping` must be 'tree' or 'siblings', got {grouping!r}")


def assign_batch_baseline(trajectories: Sequence[Trajectory]) -> None:
    """PPO's advantages without a critic: every token of a trajectory gets its reward minus the mean reward of all
    `trajectories` (the step's batch)."""
    mean = float(np.mean([t.reward for t in trajectories]))
    for t in trajectories:
        t.advantage = np.full(len(t), t.reward - mean)
