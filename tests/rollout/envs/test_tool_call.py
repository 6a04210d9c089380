"""parse_turn: tool calls, final answers and malformed turns."""

from __future__ import annotations

import pytest

from rollout.envs.tool_call import FinalAnswer, Malformed, ToolCall, parse_turn


@pytest.mark.parametrize(
    "text, parsed",
    [("<|call|>1+2<|end|>", ToolCall("1+2")),
     ("<|answer|> 3<|end|>", FinalAnswer(" 3")),
     ("<|call|>1+2", Malformed("unfinished turn")),
     ("1+2<|end|>", Malformed("expected call or answer")),
     ("<|call|>1<|tool|>2<|end|>", Malformed("unexpected marker")),
     ("<|answer|>4<|reserved_3|><|end|>", Malformed("unexpected marker")),
     ("<|end|>", Malformed("expected call or answer"))],
)
def test_parse_turn(text, parsed):
    assert parse_turn(text) == parsed
