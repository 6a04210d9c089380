"""Calculator: a multi-turn tool-use environment with a verifiable integer answer and no network.

The user asks for an integer expression; the agent calls the calculator tool, reads the result and answers:

    <|bos|><|user|>(3+4)*5<|end|><|assistant|>          prompt (reset)
    <|call|>(3+4)*5<|end|>                              assistant turn 0: tool call
    <|tool|>35<|end|><|assistant|>                      observation
    <|answer|>35<|end|>                                 assistant turn 1: reward 1 if the answer is right, done

Malformed turns, unfinished turns and bad expressions get a short `<|tool|>error: ...` observation (tool_failed), so
the agent may retry until RolloutConfig.max_turns; the reward stays 0 unless a correct answer follows.

Tasks come from the generator (`num_operations`, `max_operand`) or from records ([data] tasks, `calculator_task`):
`{"question": "(3+4)*5", "answer": 35, "steps": ["3+4", "7*5"]}` with `answer` and `steps` optional.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping, Union

from rollout.envs.base import Action, Environment, Reset, Step
from rollout.envs.records import RecordError, optional, required
from rollout.envs.tool_call import FinalAnswer, Malformed, ToolCall, parse_turn
from rollout.tokenizer import CHAT

__all__ = ["CalculatorTask", "CalculatorError", "evaluate", "calculator_task", "CalculatorEnv"]

#: Longest expression the tool accepts and largest magnitude it returns (keeps observations short).
MAX_EXPRESSION_CHARS = 48
MAX_MAGNITUDE = 10**12

_Expr = Union[int, tuple[str, "_Expr", "_Expr"]]


@dataclass(frozen=True)
class CalculatorTask:
    """One question.

    Args:
        question: the expression, e.g. "(3+4)*5".
        answer: its value.
        steps: sub-expressions that solve it one operation at a time, innermost first (e.g. "3+4", "7*5").
    """

    question: str
    answer: int
    steps: tuple[str, ...]


class CalculatorError(ValueError):
    """The tool cannot evaluate the argument; the message is short enough to become an observation."""


def evaluate(text: str) -> int:
    """Evaluate an integer expression with + - * (unary minus) and parentheses; no Python eval."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError("expression too long")
    source = text.replace(" ", "")
    pos = 0

    def peek() -> str:
        return source[pos] if pos < len(source) else ""

    def take() -> str:
        nonlocal pos
        pos += 1
        return source[pos - 1]

    def checked(value: int) -> int:
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("number too large")
        return value

    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            value = checked(value + term() if take() == "+" else value - term())
        return value

    def term() -> int:
        value = factor()
        while peek() == "*":
            take()
            value = checked(value * factor())
        return value

    def factor() -> int:
        char = peek()
        if char == "-":
            take()
            return -factor()
        if char == "(":
            take()
            value = expr()
            if peek() != ")":
                raise CalculatorError("missing )")
            take()
            return value
        digits = ""
        while peek().isdigit():
            digits += take()
        if not digits:
            raise CalculatorError("bad expression")
        return checked(int(digits))

    value = expr()
    if pos != len(source):
        raise CalculatorError("bad expression")
    return value


def _render(e: _Expr) -> str:
    if isinstance(e, int):
        return str(e)
    op, left, right = e
    parts = [_render(side) if isinstance(side, int) else f"({_render(side)})" for side in (left, right)]
    return parts[0] + op + parts[1]


def _random_expr(rng: random.Random, operations: int, max_operand: int) -> _Expr:
    if operations == 0:
        return rng.randint(0, max_operand)
    left = rng.randint(0, operations - 1)
    right = operations - 1 - left
    return (rng.choice("+-*"), _random_expr(rng, left, max_operand), _random_expr(rng, right, max_operand))


def _solve_steps(e: _Expr) -> tuple[int, list[str]]:
    """Value of `e` and the one-operation sub-expressions (with earlier results substituted), innermost first."""
    if isinstance(e, int):
        return e, []
    op, left, right = e
    a, steps_a = _solve_steps(left)
    b, steps_b = _solve_steps(right)
    step = f"{a}{op}{b}" if b >= 0 else f"{a}{op}({b})"
    return evaluate(step), [*steps_a, *steps_b, step]


def calculator_task(record: Mapping[str, Any]) -> CalculatorTask:
    """The task of a record {"question": str, "answer": int (optional, checked), "steps": [str] (optional)}.

    Without `steps` the SFT demonstration is the single call with the whole question."""
    question = required(record, "question", str)
    try:
        value = evaluate(question)
    except CalculatorError as e:
        raise RecordError(f"{question!r} is not a calculator expression ({e})", field="question") from None
    answer = optional(record, "answer", int, default=value)
    if answer != value:
        raise RecordError(f"{answer} is not the value of {question!r} ({value})", field="answer")
    steps = optional(record, "steps", list, default=[question])
    if not steps or not all(isinstance(s, str) for s in steps):
        raise RecordError(f"must be a non-empty list of strings, got {steps!r}", field="steps")
    for step in steps:
        try:
            evaluate(step)
        except CalculatorError as e:
            raise RecordError(f"{step!r} is not a calculator expression ({e})", field="steps") from None
    return CalculatorTask(question=question, answer=answer, steps=tuple(steps))


class CalculatorEnv(Environment):
    """Arithmetic questions answered with a calculator tool.

    Args:
        num_operations: operations per question (1: "12+7"; 2: "(3+4)*5", ...).
        max_operand: operands are drawn from [0, max_operand].
    """

    name = "calculator"

    def __init__(self, *, num_operations: int = 1, max_operand: int = 20) -> None:
        if num_operations < 1:
            raise ValueError(f"`num_operations` must be >= 1, got {num_operations}")
        if max_operand < 1:
            raise ValueError(f"`max_operand` must be >= 1, got {max_operand}")
        self.num_operations = num_operations
        self.max_operand = max_operand

    def sample_tasks(self, count: int, rng: random.Random) -> list[CalculatorTask]:
        tasks = []
        for _ in range(count):
            e = _random_expr(rng, self.num_operations, self.max_operand)
            answer, steps = _solve_steps(e)
            tasks.append(CalculatorTask(question=_render(e), answer=answer, steps=tuple(steps)))
        return tasks

    def task_from_record(self, record: Mapping[str, Any]) -> CalculatorTask:
        return calculator_task(record)

    def reset(self, task: CalculatorTask) -> Reset:
        return Reset(prompt=f"{CHAT.bos}{CHAT.user}{task.question}{CHAT.end}{CHAT.assistant}", state=task)

    def step(self, state: CalculatorTask, action: Action) -> Step:
        turn = parse_turn(action.text)
        if isinstance(turn, FinalAnswer):
            return Step(observation="", reward=float(turn.text.strip() == str(state.answer)), done=True, state=state)
        if isinstance(turn, Malformed):
            return self._error(state, turn.reason)
        assert isinstance(turn, ToolCall)
        try:
            value = evaluate(turn.argument)
        except CalculatorError as exc:
            return self._error(state, str(exc))
        return Step(observation=f"{CHAT.tool}{value}{CHAT.end}{CHAT.assistant}", reward=0.0, done=False, state=state)

    def solutions(self, task: CalculatorTask) -> list[list[str]]:
        """One call with the whole question, and (for several operations) one call per operation."""
        answer = f"{CHAT.answer}{task.answer}{CHAT.end}"
        whole = [f"{CHAT.call}{task.question}{CHAT.end}", answer]
        stepwise = [*(f"{CHAT.call}{s}{CHAT.end}" for s in task.steps), answer]
        return [whole] if stepwise == whole else [whole, stepwise]

    @staticmethod
    def _error(state: CalculatorTask, reason: str) -> Step:
        observation = f"{CHAT.tool}error: {reason}{CHAT.end}{CHAT.assistant}"
        return Step(observation=observation, reward=0.0, done=False, state=state, tool_failed=True)
