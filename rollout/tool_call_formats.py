"""Tool calls in a model's own format, parsed out of a sampled assistant turn.

    qwen   <tool_call>\\n{"name": "calculator", "arguments": {"expression": "3+4"}}\\n</tool_call>
           (Qwen2.5 / Qwen3 / Qwen3-Next and other Hermes-style templates; several blocks per turn)
    kimi   <|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>
           {"expression": "3+4"}<|tool_call_end|><|tool_calls_section_end|>   (Kimi K2 / Kimi-Linear)

`tool_call_format(chat_template)` picks the format whose markers the template uses (None: the template has no tool
calls, and turns are plain text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from rollout.envs.chat import ToolCallRequest

__all__ = ["ParsedTurn", "ToolCallFormat", "QWEN", "KIMI", "FORMATS", "tool_call_format"]


@dataclass(frozen=True)
class ParsedTurn:
    """A turn's text without its tool-call blocks (stripped), the calls, and why a block failed to parse."""

    content: str
    tool_calls: tuple[ToolCallRequest, ...]
    malformed: str | None = None


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: arguments are not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: arguments must be a JSON object")
    return value


def _qwen_call(body: str, index: int) -> ToolCallRequest:
    where = f"tool call {index + 1}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError(f'{where}: expected {{"name": ..., "arguments": {{...}}}}')
    return ToolCallRequest(obj["name"], _arguments(obj.get("arguments", {}), where))


def _kimi_call(body: str, index: int) -> ToolCallRequest:
    where = f"tool call {index + 1}"
    head, sep, arguments = body.partition("<|tool_call_argument_begin|>")
    call_id = head.strip()
    if not sep or not call_id:
        raise ValueError(f"{where}: expected functions.NAME:INDEX<|tool_call_argument_begin|>{{...}}")
    name = call_id.split(":", 1)[0].removeprefix("functions.")
    return ToolCallRequest(name, _arguments(arguments.strip(), where), id=call_id)


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's tool-call syntax: blocks between `open` and `close`, each parsed by `parse_call`.

    Kimi wraps its calls in a section; `section` gives that section's own (open, close) markers."""

    name: str
    open: str
    close: str
    parse_call: Callable[[str, int], ToolCallRequest]
    section: tuple[str, str] | None = None

    def parse(self, text: str) -> ParsedTurn:
        """Split `text` (one turn, without the end-of-turn token) into content and tool calls."""
        body = text
        if self.section is not None:
            begin, end = self.section
            body = re.sub(re.escape(begin) + r"|" + re.escape(end), "", text)
        pattern = re.compile(re.escape(self.open) + r"(.*?)" + re.escape(self.close), re.DOTALL)
        calls, malformed = [], None
        for i, block in enumerate(pattern.findall(body)):
            try:
                calls.append(self.parse_call(block.strip(), i))
            except ValueError as e:
                malformed = malformed or str(e)
        content = pattern.sub("", body)
        if malformed is None and self.open in content:
            malformed = f"unclosed {self.open}"
        return ParsedTurn(content.strip(), tuple(calls), malformed)


QWEN = ToolCallFormat("qwen", "<tool_call>", "</tool_call>", _qwen_call)
KIMI = ToolCallFormat("kimi", "<|tool_call_begin|>", "<|tool_call_end|>", _kimi_call,
                      section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"))
FORMATS = (QWEN, KIMI)


def tool_call_format(chat_template: str) -> ToolCallFormat | None:
    """The format whose opening marker `chat_template` contains, or None."""
    for fmt in FORMATS:
        if fmt.open in chat_template:
            return fmt
    return None
