"""Tree-shaped demonstrations for an SFT warm-up, built by replaying an environment's own solutions.

Each solution's assistant turns are tokenized with the policy tokenizer and stepped through the environment, so
observations are exactly what rollouts would see; solutions that share leading turns share nodes. The result is a
`RolloutTree` without log-probs whose trajectories carry loss_mask on assistant tokens and reward > 0.
"""

from __future__ import annotations

from typing import Any, Hashable

from rollout.envs.base import Action, Environment
from rollout.tree import RolloutTree
from rollout.validation import env_tokens

__all__ = ["demonstration_tree"]


def demonstration_tree(env: Environment, task: Any, tokenizer, tree_id: Hashable) -> RolloutTree:
    """All solutions of `task` (from `env.solutions`) merged into one tree.

    Raises:
        ValueError: a solution is empty, ends before its last turn, does not end the episode, or earns reward <= 0.
    """
    check = dict(tokenizer=tokenizer, vocab_size=len(tokenizer), env_name=env.name, tree_id=tree_id)
    reset = env.reset(task)
    tree = RolloutTree(tree_id, task)
    tree.add(None, "prompt", env_tokens(reset.prompt, max_tokens=None, turn=0, what="prompt", **check), turn=0)
    for k, solution in enumerate(env.solutions(task)):
        where = f"environment {env.name!r} solution {k} of tree {tree_id} (task {task!r})"
        if not solution:
            raise ValueError(f"{where}: has no turns")
        node, state, reward = 0, reset.state, 0.0
        for turn, text in enumerate(solution):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            action = Action(
                text=tokenizer.decode(list(ids), skip_special_tokens=False),
                token_ids=ids,
                finished=bool(ids) and ids[-1] == tokenizer.eos_token_id,
            )
            step = env.step(state, action)
            reward += step.reward
            last = turn == len(solution) - 1
            if step.done != last:
                raise ValueError(f"{where}: turn {turn} {'ends' if step.done else 'does not end'} the episode")
            node = _child(tree, node, "assistant", ids, turn)
            tree.nodes[node].reward = float(step.reward)
            observation = env_tokens(step.observation, max_tokens=None, turn=turn, what="observation", **check)
            if observation:
                node = _child(tree, node, "env", observation, turn)
            state = step.state
        if reward <= 0:
            raise ValueError(f"{where}: earns reward {reward}; solutions must be correct")
        tree.nodes[node].end = "done"
    return tree


def _child(tree: RolloutTree, parent: int, role: str, tokens, turn: int) -> int:
    """Index of the child of `parent` with these role and tokens, added if missing."""
    for index in tree.nodes[parent].children:
        child = tree.nodes[index]
        if child.role == role and child.tokens.tolist() == list(tokens):
            return index
    return tree.add(parent, role, tokens, turn).index
