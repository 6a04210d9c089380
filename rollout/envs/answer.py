"""Answer checking: questions from task records, reward 1 for a reply that matches the record's `answer`.

A record is {"prompt": str, "answer": str | number} or {"messages": [{"role": ..., "content": ...}, ...],
"answer": ...}, with an optional "system" prompt and "match" (they override the environment's `system` and
`match`). The reply is the turn's content after its last `</think>` (reasoning is not graded):

    match = "exact"    the reply equals str(answer), both with whitespace runs collapsed and ends stripped
    match = "numeric"  the last number in the reply equals the answer within a relative 1e-6 (commas in numbers
                       are ignored; the answer must be a number or a numeric string)

With `attempts` > 1 a wrong reply gets the `feedback` user message and another turn (tool_failed, so
rollout.branch_at = "retries" branches there); the first right reply ends the episode.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from rollout.envs.chat import AssistantTurn, ChatEnvironment, ChatReset, ChatStep, Message
from rollout.envs.records import RecordError, optional, required

__all__ = ["AnswerTask", "AnswerEnv", "reply_of", "last_number"]

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class AnswerTask:
    """The prompt messages, the answer as text, how replies are matched, and the answer's value (numeric only)."""

    messages: tuple[Message, ...]
    answer: str
    match: Literal["exact", "numeric"] = "exact"
    value: float | None = None


def reply_of(turn: AssistantTurn) -> str:
    """The graded part of a turn: its content after the last `</think>`, stripped."""
    return turn.content.rpartition("</think>")[2].strip()


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas between thousands ignored), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def _collapse(text: str) -> str:
    return " ".join(text.split())


class AnswerEnv(ChatEnvironment):
    """Questions with known answers (records only: there is no generator).

    Args:
        match: "exact" or "numeric" (module docstring), for records without their own.
        attempts: turns the policy gets to answer (>= 1).
        system: system prompt of records without their own.
        feedback: the user message after a wrong reply when attempts remain.
    """

    name = "answer"

    def __init__(self, *, match: Literal["exact", "numeric"] = "exact", attempts: int = 1, system: str | None = None,
                 feedback: str = "That is not correct. Try again.") -> None:
        if match not in ("exact", "numeric"):
            raise ValueError(f"`match` must be 'exact' or 'numeric', got {match!r}")
        if not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"`attempts` must be an integer >= 1, got {attempts!r}")
        self.match = match
        self.attempts = attempts
        self.system = system
        self.feedback = feedback

    def task_from_record(self, record: Mapping[str, Any]) -> AnswerTask:
        answer = required(record, "answer", str, float)
        match = optional(record, "match", str, default=self.match)
        if match not in ("exact", "numeric"):
            raise RecordError(f"must be 'exact' or 'numeric', got {match!r}", field="match")
        value = None
        if match == "numeric":
            value = float(answer) if not isinstance(answer, str) else last_number(answer)
            if value is None or not math.isfinite(value):
                raise RecordError(f"must be a finite number for match = 'numeric', got {answer!r}", field="answer")
        system = optional(record, "system", str, default=self.system)
        if "messages" in record:
            messages = required(record, "messages", list)
            for i, m in enumerate(messages):
                if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                        and isinstance(m.get("content"), str)):
                    raise RecordError(f"message {i} must be {{\"role\": \"system\" | \"user\" | \"assistant\", "
                                      f"\"content\": str}}, got {m!r}", field="messages")
            if not messages or messages[-1]["role"] != "user":
                raise RecordError("must end with a user message", field="messages")
            turns = tuple({"role": m["role"], "content": m["content"]} for m in messages)
        else:
            turns = ({"role": "user", "content": required(record, "prompt", str)},)
        if system is not None and turns[0]["role"] != "system":
            turns = ({"role": "system", "content": system}, *turns)
        text = answer if isinstance(answer, str) else (str(int(answer)) if float(answer).is_integer() else str(answer))
        return AnswerTask(messages=turns, answer=text, match=match, value=value)

    def reset(self, task: AnswerTask) -> ChatReset:
        return ChatReset(messages=list(task.messages), state=(task, 0))

    def correct(self, task: AnswerTask, turn: AssistantTurn) -> bool:
        """Whether `turn` answers `task` (an unfinished turn never does)."""
        if not turn.finished:
            return False
        reply = reply_of(turn)
        if task.match == "exact":
            return _collapse(reply) == _collapse(task.answer)
        number = last_number(reply)
        return number is not None and math.isclose(number, task.value, rel_tol=1e-6, abs_tol=1e-12)

    def step(self, state: tuple[AnswerTask, int], turn: AssistantTurn) -> ChatStep:
        task, used = state
        right = self.correct(task, turn)
        done = right or used + 1 >= self.attempts
        messages = [] if done else [{"role": "user", "content": self.feedback}]
        return ChatStep(messages=messages, reward=float(right), done=done, state=(task, used + 1),
                        tool_failed=not right)

    def solutions(self, task: AnswerTask) -> list[list[Message]]:
        return [[{"role": "assistant", "content": task.answer}]]
