"""ChatTemplate: a rollout path's tokens only grow (each turn's ids are a prefix of the next turn's), they spell the
template's rendering of the conversation, and equal its tokenization for canonically tokenized turns; templates
that rewrite earlier turns are refused by name."""

from __future__ import annotations

import pytest

from rollout.chat_template import ChatTemplate, ChatTemplateError
from rollout.envs.chat_calculator import CALCULATOR_TOOL
from tests.rollout.qwen_tokenizer import QWEN_STYLE_TEMPLATE, qwen_style_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}\n</tool_call><|im_end|>'


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def roll(template: ChatTemplate, prompt, turns, tools=None):
    """Play `turns` ((sampled reply, environment messages) pairs) the way the rollout builder does: the path's ids
    are the prompt's, then per turn the sampled ids (the reply's canonical encoding) and the observation's ids.
    Returns the conversation and the path's ids after each turn."""
    conversation, ids = template.start(prompt, tools)
    paths = [list(ids)]
    for k, (reply, messages) in enumerate(turns):
        last = k == len(turns) - 1
        conversation, observation = template.extend(conversation, reply, messages, generation_prompt=not last)
        paths.append(paths[-1] + encode(template.tokenizer, reply) + observation)
    return conversation, paths


def test_tool_turns_keep_every_path_a_prefix_of_the_next_and_equal_the_template():
    tokenizer = qwen_style_tokenizer()
    template = ChatTemplate(tokenizer)
    prompt = [{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "What is (3+4)*5?"}]
    turns = [
        ("<think>\nI need the tool.\n</think>\n\n" + CALL, [{"role": "tool", "content": "35"}]),
        (CALL.replace("(3+4)*5", "35"), [{"role": "tool", "content": "35"}, {"role": "tool", "content": "ok"}]),
        ("The answer is 35.<|im_end|>", []),
    ]
    conversation, paths = roll(template, prompt, turns, [CALCULATOR_TOOL])
    for shorter, longer in zip(paths, paths[1:]):
        assert longer[:len(shorter)] == shorter
    whole = template.render(conversation.messages, [CALCULATOR_TOOL], generation_prompt=False)
    assert conversation.text == whole
    assert tokenizer.decode(paths[-1], skip_special_tokens=False) == whole
    assert paths[-1] == encode(tokenizer, whole)


def test_a_cut_off_turn_gets_its_end_of_turn_token_in_the_observation():
    tokenizer = qwen_style_tokenizer()
    template = ChatTemplate(tokenizer)
    conversation, _ = template.start([{"role": "user", "content": "What is 2+2?"}])
    conversation, observation = template.extend(conversation, "The answer", [{"role": "user", "content": "Go on."}])
    assert tokenizer.decode(observation, skip_special_tokens=False) == \
        "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert conversation.messages[-2] == {"role": "assistant", "content": "The answer"}


def test_what_the_generation_prompt_opens_is_part_of_the_reply():
    """A template whose generation prompt opens a think block: the block is the start of the assistant message."""
    thinking = QWEN_STYLE_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}\n{%- endif %}",
                                           "{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}")
    assert thinking != QWEN_STYLE_TEMPLATE
    tokenizer = qwen_style_tokenizer(thinking)
    template = ChatTemplate(tokenizer)
    prompt = [{"role": "user", "content": "What is (3+4)*5?"}]
    turns = [("Use the tool.\n</think>\n\n" + CALL, [{"role": "tool", "content": "35"}]),
             ("Done.\n</think>\n\n35<|im_end|>", [])]
    conversation, paths = roll(template, prompt, turns, [CALCULATOR_TOOL])
    assert conversation.messages[1]["content"].startswith("<think>\nUse the tool.")
    assert paths[-1] == encode(tokenizer, conversation.text)


def test_a_template_that_drops_earlier_reasoning_is_refused_by_name():
    """Qwen3's rule: after a new user message, earlier turns lose their <think> block, so the path's text would no
    longer be a prefix of the conversation's rendering."""
    template = ChatTemplate(qwen_style_tokenizer())
    conversation, _ = template.start([{"role": "user", "content": "What is 2+2?"}])
    refused = (r"chat template of 'tiny-qwen-style' does not keep the path's earlier text as a prefix when a turn "
               r"is added \(first difference at character")
    with pytest.raises(ChatTemplateError, match=refused):
        template.extend(conversation, "<think>\nsum\n</think>\n\n5<|im_end|>",
                        [{"role": "user", "content": "That is not correct. Try again."}])
    # Without reasoning the same follow-up keeps the prefix.
    template.extend(conversation, "5<|im_end|>", [{"role": "user", "content": "That is not correct. Try again."}])


def test_reply_text_renders_tool_calls_in_the_model_format():
    template = ChatTemplate(qwen_style_tokenizer())
    conversation, _ = template.start([{"role": "user", "content": "What is (3+4)*5?"}], [CALCULATOR_TOOL])
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "(3+4)*5"}}}
    assert template.reply_text(conversation, {"role": "assistant", "content": "", "tool_calls": [call]}) == CALL


def test_templates_the_renderer_cannot_use_are_errors():
    tokenizer = qwen_style_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="'tiny-qwen-style' has no chat template"):
        ChatTemplate(tokenizer)
    end = "{{- '<|im_end|>\\n' }}\n    {%- elif m.role == 'tool'"
    other_end = qwen_style_tokenizer(QWEN_STYLE_TEMPLATE.replace(end, end.replace("im_end", "endoftext")))
    with pytest.raises(ChatTemplateError, match=r"ends an assistant turn with '<\|endoftext\|>.*'<\|im_end\|>'"):
        ChatTemplate(other_end)
