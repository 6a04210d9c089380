"""RolloutTree: paths, trajectories (tokens, loss mask, behaviour log-probs, reward) and token counts."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.tree import RolloutTree


def small_tree() -> RolloutTree:
    """prompt [1 2] -> assistant [3 4] -> env [5] -> {assistant [6] (reward 1, done), assistant [7 8] (max_turns)}"""
    tree = RolloutTree("t0")
    tree.add(None, "prompt", [1, 2], turn=0)
    first = tree.add(0, "assistant", [3, 4], turn=0, logprobs=[-1.0, -2.0], finish_reason="stop")
    first.reward = 0.25
    tree.add(first.index, "env", [5], turn=0)
    done = tree.add(2, "assistant", [6], turn=1, logprobs=[-3.0], finish_reason="stop")
    done.reward, done.end = 1.0, "done"
    cut = tree.add(2, "assistant", [7, 8], turn=1, logprobs=[-0.5, -0.25], finish_reason="length")
    cut.end = "max_turns"
    return tree


def test_trajectories():
    tree = small_tree()
    first, second = tree.trajectories()
    assert first.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert first.loss_mask.tolist() == [False, False, True, True, False, True]
    assert first.logprobs.tolist() == [0, 0, -1.0, -2.0, 0, -3.0]
    assert first.reward == 1.25 and first.tree == "t0"
    assert first.extra == {"leaf": 3, "end": "done", "turns": 2}
    assert second.tokens.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert second.loss_mask.tolist() == [False, False, True, True, False, True, True]
    assert second.logprobs.tolist() == [0, 0, -1.0, -2.0, 0, -0.5, -0.25]
    assert second.reward == 0.25 and second.extra["end"] == "max_turns"
    assert tree.num_tree_tokens() == 8 and tree.num_flat_tokens() == 13


def test_trajectories_without_logprobs_have_none():
    tree = RolloutTree(3)
    tree.add(None, "prompt", [1], turn=0)
    tree.add(0, "assistant", [2, 3], turn=0)
    (traj,) = tree.trajectories()
    assert traj.logprobs is None and traj.loss_mask.tolist() == [False, True, True]


def test_add_rejects_bad_nodes():
    tree = RolloutTree("x")
    with pytest.raises(ValueError, match="first node is the root"):
        tree.add(0, "prompt", [1], turn=0)
    tree.add(None, "prompt", [1], turn=0)
    with pytest.raises(ValueError, match="first node is the root"):
        tree.add(None, "prompt", [1], turn=0)
    with pytest.raises(ValueError, match="tree x, turn 0: 2 tokens but 1 logprobs"):
        tree.add(0, "assistant", [2, 3], turn=0, logprobs=np.zeros(1))
