"""Growing rollout trees while decoding, one turn level at a time.

All pending nodes of all trees at one assistant-turn level go to the engine as one batch: each node's full prefix is
submitted once as a token-id prompt with n = fan-out children, so siblings share the prefill through vLLM's prefix
cache. Each child's exact ids and behaviour log-probs become an assistant node; the environment's observation
becomes an env node below it, and the path continues at the next level until the environment says done, the path has
`max_turns` assistant turns, or the engine's context is full.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Hashable, Literal, Sequence

from rollout.config import RolloutConfig
from rollout.engine import Engine, EngineError, GenerationRequest
from rollout.envs.base import Action, Environment, Step
from rollout.tree import RolloutTree
from rollout.validation import EnvironmentOutputError, env_tokens

__all__ = ["build_trees"]


@dataclass
class _Pending:
    """A node whose prefix the next assistant turn continues."""

    tree: RolloutTree
    node: int
    state: Any
    turn: int
    after: Literal["start", "tool", "failure"]
    prefix_len: int


def _fan_out(config: RolloutConfig, after: str) -> int:
    branches = (
        after == "start"
        or config.branch_at == "every_turn"
        or (config.branch_at == "tool_calls" and after == "tool")
        or (config.branch_at == "retries" and after == "failure")
    )
    return config.fan_out if branches else 1


def _seed(config: RolloutConfig, tree_id: Hashable, node: int) -> int | None:
    if config.seed is None:
        return None
    return zlib.crc32(f"{config.seed}/{tree_id}/{node}".encode())


def build_trees(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Any],
    config: RolloutConfig,
    tokenizer,
    *,
    tree_ids: Sequence[Hashable] | None = None,
) -> list[RolloutTree]:
    """Roll out one tree per task.

    Args:
        engine: holds the current policy.
        env: the environment; stepped once per sampled assistant turn.
        tasks: values accepted by `env.reset`.
        config: branching and sampling policy.
        tokenizer: the policy's HF tokenizer; encodes env text, decodes actions for the env, and its
            `eos_token_id` ends an assistant turn.
        tree_ids: one unique id per task (default 0..len(tasks)-1); errors and Trajectory.tree use them.

    Returns:
        the trees, in task order.

    Raises:
        EngineError: the engine failed (a note names the turn level).
        EnvironmentOutputError: an environment prompt or observation is invalid (names the tree and turn).
    """
    tree_ids = list(range(len(tasks))) if tree_ids is None else list(tree_ids)
    if len(tree_ids) != len(tasks) or len(set(tree_ids)) != len(tree_ids):
        raise ValueError(f"`tree_ids` must hold {len(tasks)} unique ids (one per task), got {tree_ids}")
    if tokenizer.eos_token_id is None:
        raise ValueError("`tokenizer` needs an eos_token_id: it ends every assistant turn")
    check = dict(tokenizer=tokenizer, vocab_size=engine.vocab_size, env_name=env.name)

    trees, frontier = [], []
    for tree_id, task in zip(tree_ids, tasks):
        tree = RolloutTree(tree_id, task)
        try:
            reset = env.reset(task)
        except Exception as exc:
            exc.add_note(f"in environment {env.name!r} reset() for tree {tree_id}")
            raise
        prompt = env_tokens(reset.prompt, max_tokens=None, tree_id=tree_id, turn=0, what="prompt", **check)
        if not prompt:
            raise EnvironmentOutputError(f"environment {env.name!r} prompt in tree {tree_id}, turn 0: empty prompt")
        tree.add(None, "prompt", prompt, turn=0)
        trees.append(tree)
        frontier.append(_Pending(tree, 0, reset.state, 0, "start", len(prompt)))

    while frontier:
        runnable = []
        for p in frontier:
            if p.prefix_len >= engine.max_model_len:
                p.tree.nodes[p.node].end = "context_full"
            else:
                runnable.append(p)
        requests = [
            GenerationRequest(
                prompt_token_ids=p.tree.prefix_tokens(p.node),
                n=_fan_out(config, p.after),
                max_new_tokens=min(config.max_new_tokens, engine.max_model_len - p.prefix_len),
                temperature=config.temperature,
                top_p=config.top_p,
                stop_token_ids=(tokenizer.eos_token_id,),
                seed=_seed(config, p.tree.tree_id, p.node),
            )
            for p in runnable
        ]
        try:
            results = engine.generate(requests) if requests else []
        except EngineError as exc:
            exc.add_note(f"while sampling assistant turn {runnable[0].turn} of {len(runnable)} tree nodes")
            raise
        frontier = []
        for p, result in zip(runnable, results, strict=True):
            p.tree.nodes[p.node].cached_tokens = result.num_cached_tokens
            for completion in result.completions:
                frontier.extend(_grow(p, completion, env, config, tokenizer, check))
    return trees


def _grow(p: _Pending, completion, env: Environment, config: RolloutConfig, tokenizer, check: dict) -> list[_Pending]:
    """Add one sampled turn and the environment's answer below `p`; return the continuation, if any."""
    tree, tree_id = p.tree, p.tree.tree_id
    node = tree.add(p.node, "assistant", completion.token_ids, p.turn, completion.logprobs, completion.finish_reason)
    action = Action(
        text=tokenizer.decode(list(completion.token_ids), skip_special_tokens=False),
        token_ids=completion.token_ids,
        finished=completion.finish_reason == "stop",
    )
    try:
        step = env.step(p.state, action)
    except Exception as exc:
        exc.add_note(f"in environment {env.name!r} step() for tree {tree_id}, turn {p.turn}")
        raise
    if not isinstance(step, Step):
        raise EnvironmentOutputError(
            f"environment {env.name!r} step() in tree {tree_id}, turn {p.turn}: must return a Step, "
            f"got {type(step).__name__}"
        )
    node.reward = float(step.reward)
    if not step.done and p.turn + 1 >= config.max_turns:
        node.end = "max_turns"
        return []
    observation = env_tokens(
        step.observation, max_tokens=config.max_env_tokens, tree_id=tree_id, turn=p.turn, what="observation", **check
    )
    if observation:
        node = tree.add(node.index, "env", observation, p.turn)
    if step.done:
        node.end = "done"
        return []
    after = "failure" if step.tool_failed else "tool"
    prefix_len = p.prefix_len + len(completion.token_ids) + len(observation)
    return [_Pending(tree, node.index, step.state, p.turn + 1, after, prefix_len)]
