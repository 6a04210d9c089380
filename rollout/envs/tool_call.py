"""Parsing an assistant turn of the chat format into a tool call, a final answer or a malformed turn.

A well-formed turn is `<|call|>ARGUMENT<|end|>` or `<|answer|>TEXT<|end|>`, with no other special marker inside.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout.tokenizer import CHAT, ChatFormat

__all__ = ["ToolCall", "FinalAnswer", "Malformed", "parse_turn"]

#: Any special token of the tokenizer (`<|end|>`, `<|reserved_7|>`, ...).
_SPECIAL = re.compile(r"<\|[a-z0-9_]+\|>")


@dataclass(frozen=True)
class ToolCall:
    argument: str


@dataclass(frozen=True)
class FinalAnswer:
    text: str


@dataclass(frozen=True)
class Malformed:
    """A turn that is neither; `reason` is short enough to send back as an observation."""

    reason: str


def parse_turn(text: str, chat: ChatFormat = CHAT) -> ToolCall | FinalAnswer | Malformed:
    """Classify one assistant turn (decoded with special tokens kept)."""
    if not text.endswith(chat.end):
        return Malformed("unfinished turn")
    body = text[: -len(chat.end)]
    for marker, kind in ((chat.call, ToolCall), (chat.answer, FinalAnswer)):
        if body.startswith(marker):
            content = body[len(marker) :]
            if _SPECIAL.search(content):
                return Malformed("unexpected marker")
            return kind(content)
    return Malformed("expected call or answer")
