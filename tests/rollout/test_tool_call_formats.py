"""Tool calls parsed in the model's own format (Qwen / Hermes blocks, Kimi sections), and format detection."""

from __future__ import annotations

import pytest

from rollout.envs.chat import ToolCallRequest
from rollout.tool_call_formats import KIMI, QWEN, tool_call_format
from tests.rollout.qwen_tokenizer import QWEN_STYLE_TEMPLATE


def test_qwen_blocks_become_calls_and_the_rest_is_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>')
    parsed = QWEN.parse(text)
    assert parsed.content == "Let me compute."
    assert parsed.tool_calls == (ToolCallRequest("calculator", {"expression": "3+4"}),
                                 ToolCallRequest("search", {"q": "x"}))
    assert parsed.malformed is None


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "tool call 1: not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'tool call 1: expected {"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "tool call 1: arguments must be a JSON object"),
    ('<tool_call>{"name": "c", "arguments": {}}', "unclosed <tool_call>"),
], ids=["json", "no-name", "arguments", "unclosed"])
def test_malformed_qwen_calls_say_why(text, reason):
    parsed = QWEN.parse(text)
    assert parsed.malformed is not None and parsed.malformed.startswith(reason)


def test_kimi_sections_become_calls_with_ids():
    text = ("I will call it.<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
            '<|tool_call_argument_begin|>{"expression": "3+4"}<|tool_call_end|><|tool_calls_section_end|>')
    parsed = KIMI.parse(text)
    assert parsed.content == "I will call it."
    assert parsed.tool_calls == (ToolCallRequest("calculator", {"expression": "3+4"}, id="functions.calculator:0"),)
    assert KIMI.parse("<|tool_call_begin|>functions.f:0<|tool_call_end|>").malformed.startswith("tool call 1: expected")


def test_the_template_names_its_format():
    assert tool_call_format(QWEN_STYLE_TEMPLATE) is QWEN
    assert tool_call_format("{{ '<|tool_calls_section_begin|><|tool_call_begin|>' }}") is KIMI
    assert tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
