"""The interface of rollout environments (write your own by subclassing `Environment`).

The rollout builder drives an environment with a *state* value instead of a mutable object, because a tree reuses one
state for several sibling actions: `reset(task)` gives the prompt and the first state; `step(state, action)` must not
modify `state` and returns the observation, the reward for the action, whether the episode is over, and the next state.

Prompts and observations may be text (encoded with the rollout tokenizer, `add_special_tokens=False`) or token ids
(checked against the model's vocabulary). They are stored in the tree with loss mask False; the assistant's tokens
are the exact ids vLLM sampled and the environment sees them as `Action.text` (decoded with special tokens kept) and
`Action.token_ids`. An observation should end with whatever opens the next assistant turn (e.g. `<|assistant|>`).

An environment must not crash on garbage: a tiny or untrained policy emits arbitrary tokens. Answer malformed turns
with a short error observation (and `tool_failed=True`) or end the episode with reward 0.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

__all__ = ["Action", "Reset", "Step", "Environment"]


@dataclass(frozen=True)
class Action:
    """One assistant turn as sampled.

    Args:
        text: the turn decoded with special tokens kept (e.g. "<|call|>12+7<|end|>").
        token_ids: the exact sampled ids.
        finished: True if the turn ended with the end-of-turn token, False if it hit max_new_tokens.
    """

    text: str
    token_ids: tuple[int, ...]
    finished: bool


@dataclass(frozen=True)
class Reset:
    """The start of an episode: the prompt (text or token ids) and the first state."""

    prompt: str | Sequence[int]
    state: Any


@dataclass(frozen=True)
class Step:
    """The environment's answer to one action.

    Args:
        observation: text or token ids appended after the action ("" or () for nothing; ignored when the path
            ends at max_turns).
        reward: reward for this action; a trajectory's reward is the sum over its actions.
        done: the episode is over (no further assistant turn).
        state: the state after the action (a new value; the old one may be stepped again by a sibling).
        tool_failed: the action was a malformed or failing tool call (branch_at="retries" branches after it).
    """

    observation: str | Sequence[int]
    reward: float
    done: bool
    state: Any
    tool_failed: bool = False


class Environment(ABC):
    """A multi-turn environment with a verifiable reward."""

    name: ClassVar[str]

    @abstractmethod
    def sample_tasks(self, count: int, rng: random.Random) -> list[Any]:
        """Draw `count` tasks (any values `reset` accepts)."""

    def task_from_record(self, record: Mapping[str, Any]) -> Any:
        """The task of one dataset record (`[data] tasks`: a JSONL object or a Parquet row). Read fields with
        `rollout.envs.records.required` / `optional` and raise `RecordError` naming the field for a bad record."""
        raise NotImplementedError(f"environment {self.name!r} does not read task records ([data] tasks): "
                                  "it needs a task_from_record() method")

    @abstractmethod
    def reset(self, task: Any) -> Reset:
        """Start an episode for `task`."""

    @abstractmethod
    def step(self, state: Any, action: Action) -> Step:
        """React to one assistant turn without modifying `state`."""

    def solutions(self, task: Any) -> list[list[str]]:
        """Correct solutions of `task` for SFT demonstrations: each a list of assistant-turn texts (every turn ending
        with the end-of-turn marker). Solutions sharing leading turns share tree nodes in `demonstration_tree`."""
        raise NotImplementedError(f"environment {self.name!r} provides no solutions(); SFT demonstrations need them")
