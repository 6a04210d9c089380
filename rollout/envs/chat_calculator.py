"""The calculator task in chat messages: the model calls a `calculator` tool in its own tool-call format.

    user       What is (3+4)*5? Use the calculator tool, then reply with the number.
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}</tool_call>   (Qwen)
    tool       35
    assistant  35                                              reward 1 if its last number is the answer, done

Tasks come from the calculator's generator or from records (rollout.envs.calculator.calculator_task). A turn that
is cut off, has a malformed call, calls another tool or passes a bad expression gets an "error: ..." tool message
(tool_failed) and another turn, as in the character-format calculator.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from rollout.envs.answer import last_number, reply_of
from rollout.envs.calculator import CalculatorEnv, CalculatorError, CalculatorTask, calculator_task, evaluate
from rollout.envs.chat import AssistantTurn, ChatEnvironment, ChatReset, ChatStep, Message, ToolCallRequest

__all__ = ["CALCULATOR_TOOL", "ChatCalculatorEnv"]

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*5"}},
            "required": ["expression"],
        },
    },
}


class ChatCalculatorEnv(ChatEnvironment):
    """Arithmetic questions answered with a calculator tool, in chat messages.

    Args:
        num_operations, max_operand: the generator's settings (rollout.envs.calculator.CalculatorEnv).
        system: an optional system prompt.
    """

    name = "chat_calculator"

    def __init__(self, *, num_operations: int = 1, max_operand: int = 20, system: str | None = None) -> None:
        self.generator = CalculatorEnv(num_operations=num_operations, max_operand=max_operand)
        self.system = system

    def sample_tasks(self, count: int, rng: random.Random) -> list[CalculatorTask]:
        return self.generator.sample_tasks(count, rng)

    def task_from_record(self, record: Mapping[str, Any]) -> CalculatorTask:
        return calculator_task(record)

    def reset(self, task: CalculatorTask) -> ChatReset:
        question = {"role": "user",
                    "content": f"What is {task.question}? Use the calculator tool, then reply with the number."}
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return ChatReset(messages=[*system, question], state=task, tools=[CALCULATOR_TOOL])

    def step(self, state: CalculatorTask, turn: AssistantTurn) -> ChatStep:
        if not turn.finished:
            return self._error(state, "unfinished turn")
        if turn.malformed is not None:
            return self._error(state, turn.malformed)
        if not turn.tool_calls:
            right = last_number(reply_of(turn)) == state.answer
            return ChatStep(messages=[], reward=float(right), done=True, state=state)
        results = [self._call(call) for call in turn.tool_calls]
        failed = any(text.startswith("error:") for _, text in results)
        messages = [_tool_message(call, text) for call, text in results]
        return ChatStep(messages=messages, reward=0.0, done=False, state=state, tool_failed=failed)

    def solutions(self, task: CalculatorTask) -> list[list[Message]]:
        """One call with the whole question, then the answer."""
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": task.question}}}
        return [[{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "assistant", "content": str(task.answer)}]]

    @staticmethod
    def _call(call: ToolCallRequest) -> tuple[ToolCallRequest, str]:
        if call.name != "calculator":
            return call, f"error: unknown tool {call.name!r}"
        expression = call.arguments.get("expression")
        if not isinstance(expression, str):
            return call, 'error: arguments must be {"expression": "..."}'
        try:
            return call, str(evaluate(expression))
        except CalculatorError as e:
            return call, f"error: {e}"

    @staticmethod
    def _error(state: CalculatorTask, reason: str) -> ChatStep:
        return ChatStep(messages=[{"role": "tool", "content": f"error: {reason}"}], reward=0.0, done=False,
                        state=state, tool_failed=True)


def _tool_message(call: ToolCallRequest, text: str) -> Message:
    message = {"role": "tool", "name": call.name, "content": text}
    if call.id is not None:
        message["tool_call_id"] = call.id
    return message
