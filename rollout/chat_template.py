"""Rendering a rollout path's chat messages with the policy tokenizer's chat template, so that its tokens only grow.

A rollout tree needs every turn's tokens to be an exact prefix of the next turn's: siblings share their parent's
tokens, and the trainer scores exactly the ids the engine sampled. Re-rendering and re-tokenizing the whole
conversation each turn does not give that (a sampled turn need not be the tokenizer's canonical encoding of its
text, and templates may rewrite earlier turns). So the renderer works on text and appends:

    prompt        ids = encode(render(messages, generation prompt))
    after a turn  the assistant message = (what the generation prompt put after the assistant header) + the
                  sampled text without its end-of-turn token; the template renders the whole conversation with the
                  new messages; the text the path's tokens spell (rendering so far + sampled text) must be a prefix
                  of it, else ChatTemplateError names the template and the first differing characters; the
                  observation is encode(rest)

The path's tokens are therefore prompt ids, the exact sampled ids and each observation's ids, and they decode to
the template's rendering of the conversation. Observations start right after an end-of-turn special token, where
tokenizers split, so for canonically tokenized turns the ids equal encode(render(whole conversation)) as well
(tests/rollout/test_chat_template.py checks both).

Templates that rewrite earlier assistant turns break the prefix and are refused at the turn where they do: Qwen3's
drops the `<think>` reasoning of turns before the newest user message (a user follow-up after a reasoning turn), and
its `enable_thinking=False` prompt adds an empty think block that history omits. Tool results (role "tool") keep
Qwen templates' prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rollout.validation import EnvironmentOutputError

__all__ = ["ChatTemplateError", "Conversation", "ChatTemplate"]

_USER = {"role": "user", "content": "ARBOR-PROBE-USER"}
_REPLY = "ARBOR-PROBE-REPLY"


class ChatTemplateError(EnvironmentOutputError):
    """The chat template cannot render a rollout path incrementally; the message names the template."""


@dataclass(frozen=True)
class Conversation:
    """A rollout path in messages and the text its tokens spell.

    Args:
        messages: every message so far (the assistant turns as sampled).
        tools: the tool schemas passed to the template on every render.
        text: the template's rendering of `messages`, ending with the generation prompt when a turn is due.
        reply_prefix: what that generation prompt put after the assistant header (e.g. "<think>\\n"): the start of
            the next assistant message's content.
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None
    text: str
    reply_prefix: str


class ChatTemplate:
    """The chat template of `tokenizer` (a Hugging Face tokenizer with `chat_template` set), rendered incrementally.

    Checked once here: assistant content is rendered verbatim, assistant turns end with the tokenizer's eos token
    (the token that stops generation), and the generation prompt is appended at the end.

    Raises:
        ChatTemplateError: no template, or one that fails these checks.
    """

    def __init__(self, tokenizer, **template_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        path = tokenizer.name_or_path
        which = f"the tokenizer {path!r}" if path else \
            "the tokenizer (built in memory, like the model presets' character tokenizer)"
        self.name = f"the chat template of {path!r}" if path else "the tokenizer's chat template"
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"{which} has no chat template; chat environments need one (model.hf_path: a "
                                    "checkpoint whose tokenizer_config.json or chat_template.jinja defines it)")
        self.eos = tokenizer.eos_token
        if not self.eos:
            raise ChatTemplateError(f"{which} has no eos token (it ends every assistant turn)")
        base = self.render([_USER], None, generation_prompt=False)
        probe = self.render([_USER, {"role": "assistant", "content": _REPLY}, _USER], None, generation_prompt=False)
        start = probe.find(_REPLY, len(base)) if probe.startswith(base) else -1
        if start < 0:
            raise ChatTemplateError(f"{self.name} does not render an assistant message's content verbatim after the "
                                    "earlier messages")
        self.header = probe[len(base):start]
        """What the template writes before an assistant message's content (e.g. "<|im_start|>assistant\\n")."""
        after = probe[start + len(_REPLY):]
        if not after.startswith(self.eos):
            raise ChatTemplateError(f"{self.name} ends an assistant turn with {after[:24]!r}, not with the "
                                    f"tokenizer's eos token {self.eos!r}, which stops generation")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, *,
               generation_prompt: bool) -> str:
        """The template applied to `messages` as text."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=None if tools is None else [dict(t) for t in tools],
            add_generation_prompt=generation_prompt, tokenize=False, **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[Conversation, list[int]]:
        """The prompt: the conversation of `messages` ready for the first assistant turn, and its token ids."""
        messages = tuple(dict(m) for m in messages)
        tools = None if tools is None else tuple(tools)
        text = self.render(messages, tools, generation_prompt=True)
        return Conversation(messages, tools, text, self._reply_prefix(messages, tools, text)), self.encode(text)

    def extend(self, conversation: Conversation, reply: str, messages: Sequence[Mapping[str, Any]], *,
               generation_prompt: bool = True) -> tuple[Conversation, list[int]]:
        """Append a sampled assistant turn and the environment's `messages`.

        Args:
            conversation: the path before the turn.
            reply: the turn as sampled, decoded with special tokens kept (ending with the eos token if finished).
            messages: the environment's answer ([] for none).
            generation_prompt: end with the next assistant turn's generation prompt (False when the episode ends).

        Returns:
            the extended conversation and the observation's token ids (everything the template writes after the
            sampled turn: its end-of-turn token when the turn was cut off, the new messages, the generation prompt).

        Raises:
            ChatTemplateError: the template's rendering of the extended conversation does not start with the text
                of the path so far.
        """
        assistant = {"role": "assistant", "content": conversation.reply_prefix + reply.removesuffix(self.eos)}
        extended = (*conversation.messages, assistant, *(dict(m) for m in messages))
        spelled = conversation.text + reply
        full = self.render(extended, conversation.tools, generation_prompt=generation_prompt)
        if not full.startswith(spelled):
            raise ChatTemplateError(self._mismatch(spelled, full))
        prefix = self._reply_prefix(extended, conversation.tools, full) if generation_prompt else ""
        return Conversation(extended, conversation.tools, full, prefix), self.encode(full[len(spelled):])

    def reply_text(self, conversation: Conversation, message: Mapping[str, Any]) -> str:
        """The assistant turn the template renders for `message` after `conversation`, through its eos token: what
        the policy would sample to say `message` (SFT demonstrations; tool calls come out in the model's format)."""
        full = self.render((*conversation.messages, dict(message)), conversation.tools, generation_prompt=False)
        if not full.startswith(conversation.text):
            raise ChatTemplateError(self._mismatch(conversation.text, full))
        rest = full[len(conversation.text):]
        end = rest.find(self.eos)
        if end < 0:
            raise ChatTemplateError(f"{self.name} renders the assistant message {dict(message)!r} without the eos "
                                    f"token {self.eos!r}")
        return rest[: end + len(self.eos)]

    def _reply_prefix(self, messages, tools, text: str) -> str:
        plain = self.render(messages, tools, generation_prompt=False)
        if not text.startswith(plain) or not text[len(plain):].startswith(self.header):
            raise ChatTemplateError(f"{self.name} does not end with the assistant header {self.header!r} when asked "
                                    "for a generation prompt")
        return text[len(plain) + len(self.header):]

    def _mismatch(self, spelled: str, full: str) -> str:
        i = next((k for k, (a, b) in enumerate(zip(spelled, full)) if a != b), min(len(spelled), len(full)))
        return (f"{self.name} does not keep the path's earlier text as a prefix when a turn is added "
                f"(first difference at character {i}: the path has {spelled[max(0, i - 24):i + 24]!r}, the template "
                f"renders {full[max(0, i - 24):i + 24]!r}); tree rollouts need a template that renders earlier "
                "turns verbatim (Qwen3's, for example, drops the reasoning of turns before the newest user message)")
