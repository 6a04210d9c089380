"""Rollout trees: the token segments produced while decoding, kept as a tree with their roles and log-probs.

A tree has one `prompt` root; below it `assistant` nodes (tokens sampled by the policy, with behaviour log-probs)
alternate with `env` nodes (observation tokens from the environment). A node's token ids are exactly what vLLM
returned (assistant) or what the environment produced (prompt, env); nothing is re-tokenized. Every root-to-leaf path
is one `planner.trajectory.Trajectory`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

import numpy as np

from planner.trajectory import Trajectory

__all__ = ["Role", "PathEnd", "TreeNode", "RolloutTree"]

Role = Literal["prompt", "assistant", "env"]

#: Why a path stopped growing: the environment said done, the path reached `RolloutConfig.max_turns`, or the next
#: turn would not fit into the engine's context (`max_model_len`).
PathEnd = Literal["done", "max_turns", "context_full"]


@dataclass(eq=False)
class TreeNode:
    """One segment of tokens in a rollout tree.

    Args:
        index: position in `RolloutTree.nodes`.
        parent: index of the parent node, None for the root.
        role: "prompt" (root), "assistant" (sampled by the policy) or "env" (environment observation).
        tokens: [L] int64 token ids of this segment (L >= 1 except for empty assistant turns, which vLLM never returns).
        turn: assistant-turn index this segment belongs to: the prompt and the first assistant turn are turn 0, the
            observation answering turn k is turn k.
        logprobs: [L] float64 behaviour log-probs of `tokens` (assistant nodes sampled by an engine), else None.
        reward: reward the environment gave for this assistant turn (0 for other roles).
        finish_reason: for assistant nodes, "stop" (end-of-turn token sampled) or "length" (max_new_tokens reached).
        end: why the path ends here (leaves only), else None.
        cached_tokens: prompt tokens the engine served from its prefix cache when this node's prefix was submitted.
        children: indices of the child nodes.
    """

    index: int
    parent: int | None
    role: Role
    tokens: np.ndarray
    turn: int
    logprobs: np.ndarray | None = None
    reward: float = 0.0
    finish_reason: str | None = None
    end: PathEnd | None = None
    cached_tokens: int = 0
    children: list[int] = field(default_factory=list)


class RolloutTree:
    """A rollout tree: nodes with parents, token ids, roles, behaviour log-probs and turn indices.

    Args:
        tree_id: identifier used in errors and copied into every Trajectory's `tree`.
        task: the task the environment was reset with (kept for logging and pictures).
    """

    def __init__(self, tree_id: Hashable, task: object = None) -> None:
        self.tree_id = tree_id
        self.task = task
        self.nodes: list[TreeNode] = []

    def add(
        self,
        parent: int | None,
        role: Role,
        tokens: Sequence[int],
        turn: int,
        logprobs: Sequence[float] | None = None,
        finish_reason: str | None = None,
    ) -> TreeNode:
        """Append a node below `parent` (None only for the first node) and return it."""
        if (parent is None) != (not self.nodes):
            raise ValueError(
                f"tree {self.tree_id}: exactly the first node is the root (parent None), got parent {parent}"
            )
        ids = np.asarray(tokens, dtype=np.int64)
        lp = None if logprobs is None else np.asarray(logprobs, dtype=np.float64)
        if lp is not None and lp.shape != ids.shape:
            raise ValueError(f"tree {self.tree_id}, turn {turn}: {ids.size} tokens but {lp.size} logprobs")
        node = TreeNode(
            index=len(self.nodes),
            parent=parent,
            role=role,
            tokens=ids,
            turn=turn,
            logprobs=lp,
            finish_reason=finish_reason,
        )
        self.nodes.append(node)
        if parent is not None:
            self.nodes[parent].children.append(node.index)
        return node

    @property
    def root(self) -> TreeNode:
        return self.nodes[0]

    def path(self, index: int) -> list[TreeNode]:
        """Nodes from the root down to node `index`, root first."""
        nodes = []
        node: int | None = index
        while node is not None:
            nodes.append(self.nodes[node])
            node = self.nodes[node].parent
        return nodes[::-1]

    def prefix_tokens(self, index: int) -> list[int]:
        """All token ids from the root through node `index` (the prompt an engine continues from)."""
        return [int(t) for n in self.path(index) for t in n.tokens]

    def leaves(self) -> list[TreeNode]:
        return [n for n in self.nodes if not n.children]

    def trajectories(self) -> list[Trajectory]:
        """One Trajectory per leaf, in node order.

        loss_mask is True on assistant tokens only; logprobs hold the behaviour log-probs of assistant tokens and 0
        elsewhere (None when no assistant node carries log-probs, e.g. demonstrations); reward is the sum of the
        assistant-turn rewards along the path. `extra` holds the leaf index, the path end and the number of turns.
        """
        with_logprobs = any(n.logprobs is not None for n in self.nodes)
        out = []
        for leaf in self.leaves():
            path = self.path(leaf.index)
            tokens = np.concatenate([n.tokens for n in path])
            mask = np.concatenate([np.full(n.tokens.size, n.role == "assistant") for n in path])
            logprobs = None
            if with_logprobs:
                logprobs = np.concatenate(
                    [n.logprobs if n.logprobs is not None else np.zeros(n.tokens.size) for n in path]
                )
            out.append(
                Trajectory(
                    tokens=tokens,
                    loss_mask=mask,
                    logprobs=logprobs,
                    reward=float(sum(n.reward for n in path)),
                    tree=self.tree_id,
                    extra={"leaf": leaf.index, "end": leaf.end, "turns": sum(n.role == "assistant" for n in path)},
                )
            )
        return out

    def num_tree_tokens(self) -> int:
        """Tokens stored once per node (what tree execution processes)."""
        return int(sum(n.tokens.size for n in self.nodes))

    def num_flat_tokens(self) -> int:
        """Tokens summed over all root-to-leaf paths (what trajectory-wise execution processes)."""
        return int(sum(len(self.prefix_tokens(leaf.index)) for leaf in self.leaves()))
