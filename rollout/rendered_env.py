"""A chat environment as a token environment: messages rendered with the policy's chat template, turns parsed in
the model's tool-call format.

`RenderedEnvironment` is a `rollout.envs.Environment`, so the rollout builder and SFT demonstrations drive it like
any other: its prompts and observations are token ids from `rollout.chat_template.ChatTemplate` (every turn's ids a
prefix of the next turn's), and each sampled turn reaches the chat environment as an `AssistantTurn`. Its state is
(the chat environment's state, the `Conversation` so far).
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from rollout.chat_template import ChatTemplate, Conversation
from rollout.envs.base import Action, Environment, Reset, Step
from rollout.envs.chat import AssistantTurn, ChatEnvironment, ChatReset, ChatStep, check_messages
from rollout.tool_call_formats import ToolCallFormat, tool_call_format
from rollout.validation import EnvironmentOutputError

__all__ = ["RenderedEnvironment"]


class RenderedEnvironment(Environment):
    """`env` speaking the token ids of `template`'s tokenizer.

    Args:
        env: the chat environment.
        template: the policy tokenizer's chat template.
        tool_calls: the model's tool-call format; default: the one the template's text uses (None: turns are plain
            text).
    """

    def __init__(self, env: ChatEnvironment, template: ChatTemplate,
                 tool_calls: ToolCallFormat | None = None) -> None:
        self.env = env
        self.name = env.name
        self.template = template
        self.tool_calls = tool_calls or tool_call_format(str(template.tokenizer.chat_template))

    def sample_tasks(self, count: int, rng: random.Random) -> list[Any]:
        return self.env.sample_tasks(count, rng)

    def task_from_record(self, record: Mapping[str, Any]) -> Any:
        return self.env.task_from_record(record)

    def reset(self, task: Any) -> Reset:
        reset = self.env.reset(task)
        if not isinstance(reset, ChatReset):
            raise EnvironmentOutputError(f"environment {self.name!r} reset() must return a ChatReset, "
                                         f"got {type(reset).__name__}")
        messages = check_messages(reset.messages, f"environment {self.name!r} reset()")
        conversation, ids = self.template.start(messages, reset.tools)
        return Reset(prompt=ids, state=(reset.state, conversation))

    def step(self, state: tuple[Any, Conversation], action: Action) -> Step:
        inner, conversation = state
        turn = self.turn(conversation, action)
        step = self.env.step(inner, turn)
        if not isinstance(step, ChatStep):
            raise EnvironmentOutputError(f"environment {self.name!r} step() must return a ChatStep, "
                                         f"got {type(step).__name__}")
        messages = check_messages(step.messages, f"environment {self.name!r} step()")
        if step.done and not messages:
            return Step(observation=(), reward=step.reward, done=True, state=(step.state, conversation))
        conversation, ids = self.template.extend(conversation, action.text, messages,
                                                 generation_prompt=not step.done)
        return Step(observation=ids, reward=step.reward, done=step.done, state=(step.state, conversation),
                    tool_failed=step.tool_failed)

    def turn(self, conversation: Conversation, action: Action) -> AssistantTurn:
        """The sampled `action` as the chat environment sees it."""
        eos = self.template.eos
        text = conversation.reply_prefix + (action.text.removesuffix(eos) if action.finished else action.text)
        if self.tool_calls is None:
            return AssistantTurn(text=text, content=text.strip(), finished=action.finished)
        parsed = self.tool_calls.parse(text)
        return AssistantTurn(text=text, content=parsed.content, tool_calls=parsed.tool_calls,
                             finished=action.finished, malformed=parsed.malformed)

    def solutions(self, task: Any) -> list[list[str]]:
        """The chat environment's solutions as turn texts in the model's format: each assistant message rendered by
        the template after the conversation so far (the environment is stepped to produce the observations)."""
        tokenizer = self.template.tokenizer
        texts = []
        for solution in self.env.solutions(task):
            state = self.reset(task).state
            turns = []
            for message in solution:
                text = self.template.reply_text(state[1], message)
                ids = tuple(self.template.encode(text))
                action = Action(text=tokenizer.decode(list(ids), skip_special_tokens=False), token_ids=ids,
                                finished=True)
                state = self.step(state, action).state
                turns.append(text)
            texts.append(turns)
        return texts
