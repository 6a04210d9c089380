"""The interface of chat-message environments (write your own by subclassing `ChatEnvironment`).

A chat environment speaks messages instead of text: `reset(task)` gives the first messages (system, user) and the
tool schemas; `step(state, turn)` reads one assistant turn, already split into its text and tool calls in the
model's own format, and answers with new messages (tool results, user follow-ups). The app renders the messages
with the policy tokenizer's chat template (`rollout.envs.rendered.RenderedEnvironment`), so one environment serves
every model family whose template the renderer accepts. States follow `rollout.envs.base`: `step` must not modify
`state`, because siblings in a tree step the same state.

Messages are dicts in the Hugging Face chat format:

    {"role": "system" | "user" | "tool", "content": str}                    from the environment
    {"role": "tool", "content": str, "name": str, "tool_call_id": str}     a tool result (name and id optional)
    {"role": "assistant", "content": str, "tool_calls": [...]}            solutions() only (tool_calls optional,
                                                                            {"type": "function", "function":
                                                                            {"name": str, "arguments": dict}})
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from rollout.validation import EnvironmentOutputError

__all__ = ["Message", "ToolCallRequest", "AssistantTurn", "ChatReset", "ChatStep", "ChatEnvironment",
           "check_messages"]

Message = dict[str, Any]

_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCallRequest:
    """One tool call of an assistant turn: the function name, its JSON arguments, and the call id when the format
    has one (Kimi's "functions.name:0")."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class AssistantTurn:
    """One sampled assistant turn.

    Args:
        text: the whole message content as the template would hold it (decoded with special tokens kept, without
            the end-of-turn token; it starts with whatever the generation prompt put there, e.g. "<think>\\n").
        content: `text` without its tool-call blocks, stripped.
        tool_calls: the parsed calls, in order.
        finished: the turn ended with the end-of-turn token (False: it hit max_new_tokens).
        malformed: why a tool-call block could not be parsed (bad JSON, no name, unclosed block), or None.
    """

    text: str
    content: str
    tool_calls: tuple[ToolCallRequest, ...] = ()
    finished: bool = True
    malformed: str | None = None


@dataclass(frozen=True)
class ChatReset:
    """The start of an episode: the first messages, the tools offered (JSON schemas for the template's `tools`
    argument, or None), and the first state."""

    messages: Sequence[Message]
    state: Any
    tools: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class ChatStep:
    """The environment's answer to one turn: new messages ([] for none), the turn's reward, whether the episode is
    over, the next state and whether the turn was a failed or malformed tool call (see rollout.envs.base.Step)."""

    messages: Sequence[Message]
    reward: float
    done: bool
    state: Any
    tool_failed: bool = False


class ChatEnvironment(ABC):
    """A multi-turn environment in chat messages with a verifiable reward."""

    name: ClassVar[str]

    def sample_tasks(self, count: int, rng: random.Random) -> list[Any]:
        """Draw `count` tasks; environments that only read records ([data] tasks) keep this default."""
        raise NotImplementedError(f"environment {self.name!r} has no task generator: give it task records "
                                  "([data] tasks = \"PATH or glob\")")

    def task_from_record(self, record: Mapping[str, Any]) -> Any:
        """The task of one dataset record; see rollout.envs.base.Environment.task_from_record."""
        raise NotImplementedError(f"environment {self.name!r} does not read task records ([data] tasks): "
                                  "it needs a task_from_record() method")

    @abstractmethod
    def reset(self, task: Any) -> ChatReset:
        """Start an episode for `task`."""

    @abstractmethod
    def step(self, state: Any, turn: AssistantTurn) -> ChatStep:
        """React to one assistant turn without modifying `state`."""

    def solutions(self, task: Any) -> list[list[Message]]:
        """Correct solutions for SFT demonstrations: each a list of assistant messages (one per turn); the template
        renders them, tool calls included, in the model's format."""
        raise NotImplementedError(f"environment {self.name!r} provides no solutions(); SFT demonstrations need them")


def check_messages(messages: Any, where: str) -> tuple[Message, ...]:
    """`messages` as a tuple after checking each is a dict with a known role and string content.

    Raises:
        EnvironmentOutputError: naming `where`, the message index and the problem.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise EnvironmentOutputError(f"{where}: messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise EnvironmentOutputError(f"{where}: message {i} must be a dict, got {type(m).__name__}")
        if m.get("role") not in _ROLES:
            raise EnvironmentOutputError(f"{where}: message {i} has role {m.get('role')!r}, not one of "
                                         f"{', '.join(_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise EnvironmentOutputError(f"{where}: message {i} ({m['role']}) needs string content, "
                                         f"got {m.get('content')!r}")
    return tuple(dict(m) for m in messages)
