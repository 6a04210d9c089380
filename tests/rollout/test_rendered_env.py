"""Chat environments in rollout trees: RenderedEnvironment with the Qwen-style tokenizer, a scripted engine and the
real rollout builder / demonstration builder. Every path's ids must spell, and tokenize to, the template's
rendering of that path's conversation."""

from __future__ import annotations

import numpy as np
import pytest

from rollout import RolloutConfig, build_trees, demonstration_tree
from rollout.chat_template import ChatTemplate
from rollout.engine import Completion, Engine, GenerationResult
from rollout.envs import AnswerEnv, ChatCalculatorEnv
from rollout.envs.calculator import calculator_task
from rollout.rendered_env import RenderedEnvironment
from tests.rollout.qwen_tokenizer import qwen_style_tokenizer

TOKENIZER = qwen_style_tokenizer()
TEMPLATE = ChatTemplate(TOKENIZER)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}\n</tool_call><|im_end|>'


class Scripted(Engine):
    """At the first turn completion 0 is a malformed call and the others a correct one; after an error a correct
    call; after a result the number."""

    vocab_size = property(lambda self: len(TOKENIZER))
    max_model_len = property(lambda self: 2048)

    def generate(self, requests):
        return [GenerationResult([self._complete(r, i) for i in range(r.n)], 0) for r in requests]

    def _complete(self, request, i):
        prompt = TOKENIZER.decode(list(request.prompt_token_ids), skip_special_tokens=False)
        last = prompt.rsplit("<|im_start|>user\n", 1)[1]
        if "<tool_response>\n35\n" in last:
            text = "It is 35.<|im_end|>"
        elif "error" in last or i > 0:
            text = CALL
        else:
            text = '<tool_call>{"name": "calculator", "arguments": </tool_call><|im_end|>'
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
        return Completion(tuple(ids), tuple(-1.0 for _ in ids), "stop")

    def reseed(self, seed):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


class Recording(RenderedEnvironment):
    """Remembers every conversation it produced, keyed by its text."""

    def __init__(self, env):
        super().__init__(env, TEMPLATE)
        self.seen = {}

    def step(self, state, action):
        step = super().step(state, action)
        self.seen[step.state[1].text] = step.state[1]
        return step


def assert_paths_follow_the_template(env: Recording, trajectories) -> None:
    """Each path's text = the deepest conversation it extends + a final reply; re-rendered with that reply it must
    give the path's text, and tokenizing that text must give the path's ids."""
    for t in trajectories:
        text = TOKENIZER.decode(t.tokens.tolist(), skip_special_tokens=False)
        base = max((c for key, c in env.seen.items() if text.startswith(key)), key=lambda c: len(c.text))
        reply = text[len(base.text):]
        messages = [*base.messages, {"role": "assistant", "content": reply.removesuffix("<|im_end|>")}]
        assert TEMPLATE.render(messages, base.tools, generation_prompt=False).startswith(text)
        assert TOKENIZER(text, add_special_tokens=False)["input_ids"] == t.tokens.tolist()


def test_calculator_tree_parses_qwen_tool_calls_and_keeps_the_template():
    env = Recording(ChatCalculatorEnv())
    task = calculator_task({"question": "(3+4)*5"})
    config = RolloutConfig(fan_out=2, branch_at="retries", max_turns=3, max_env_tokens=256)
    (tree,) = build_trees(Scripted(), env, [task], config, TOKENIZER)
    trajectories = tree.trajectories()
    # Call -> 35 -> answer; malformed call -> error -> call (twice: retries branch) -> 35 -> answer.
    assert sorted(t.extra["turns"] for t in trajectories) == [2, 3, 3]
    assert [t.reward for t in trajectories] == [1.0, 1.0, 1.0]
    assert all(t.extra["end"] == "done" for t in trajectories)
    errors = [c for c in env.seen.values() if "error: tool call 1: not JSON" in c.text]
    assert errors and all(c.messages[-1]["role"] == "tool" for c in errors)
    assert_paths_follow_the_template(env, trajectories)


def test_calculator_demonstrations_render_calls_in_the_model_format():
    env = Recording(ChatCalculatorEnv())
    tree = demonstration_tree(env, calculator_task({"question": "(3+4)*5", "answer": 35}), TOKENIZER, "sft")
    (trajectory,) = tree.trajectories()
    assert trajectory.reward == 1.0
    text = TOKENIZER.decode(trajectory.tokens[trajectory.loss_mask].tolist(), skip_special_tokens=False)
    assert text == CALL + "35<|im_end|>"
    assert_paths_follow_the_template(env, [trajectory])


def test_answer_env_retries_share_the_prompt_and_the_wrong_turn():
    class Guesses(Scripted):
        def _complete(self, request, i):
            prompt = TOKENIZER.decode(list(request.prompt_token_ids), skip_special_tokens=False)
            text = ("Paris" if "Try again" in prompt or i == 1 else "Lyon") + "<|im_end|>"
            ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
            return Completion(tuple(ids), tuple(-1.0 for _ in ids), "stop")

    env = Recording(AnswerEnv(attempts=2))
    task = env.task_from_record({"prompt": "What is the capital of France?", "answer": "Paris"})
    config = RolloutConfig(fan_out=2, branch_at="retries", max_turns=2, max_env_tokens=64)
    (tree,) = build_trees(Guesses(), env, [task], config, TOKENIZER)
    trajectories = tree.trajectories()
    assert sorted(t.reward for t in trajectories) == [1.0, 1.0, 1.0]
    prompt = tree.nodes[0].tokens
    assert all(np.array_equal(t.tokens[:len(prompt)], prompt) for t in trajectories)
    assert_paths_follow_the_template(env, trajectories)


def test_chat_environment_output_is_checked():
    class Wrong(ChatCalculatorEnv):
        def step(self, state, turn):
            step = super().step(state, turn)
            return type(step)(messages=[{"role": "tool", "content": 35}], reward=0.0, done=False, state=state)

    env = RenderedEnvironment(Wrong(), TEMPLATE)
    with pytest.raises(ValueError, match=r"'chat_calculator' step\(\): message 0 \(tool\) needs string content"):
        build_trees(Scripted(), env, [calculator_task({"question": "2+2"})], RolloutConfig(fan_out=1), TOKENIZER)
