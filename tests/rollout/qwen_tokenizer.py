"""A tiny byte-level BPE tokenizer with a Qwen-style Jinja chat template, built in the test (no hub).

Like Qwen's: ChatML turns (`<|im_start|>role\\n ... <|im_end|>\\n`), eos `<|im_end|>`, tool schemas in the system
turn, tool calls as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, consecutive tool results in one
user turn as `<tool_response>` blocks, and Qwen3's reasoning rule: an assistant turn's `<think>` block is kept
(normalised) only for turns after the newest user message.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN_STYLE_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nTo call a function, write for each call:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\nFunctions:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- if loop.index0 > ns.last_query %}
                {%- set content = '<think>\n' + reasoning + '\n</think>\n\n' + content %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content }}
        {%- for call in m.tool_calls or [] %}
            {%- set f = call.function if call.function is defined else call %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
_CORPUS = [
    "You are a helpful assistant.", "What is (3+4)*5? Use the calculator tool, then reply with the number.",
    '{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}', "The answer is 35.", "system user assistant",
    "That is not correct. Try again.", "Let me think about it step by step.", "What is the capital of France? Paris",
]


def qwen_style_tokenizer(template: str = QWEN_STYLE_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE (about 400 tokens, merges learned from a few chat-like strings) with `template`."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(_CORPUS * 8, trainer)
    core.add_tokens(_ADDED)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        name_or_path="tiny-qwen-style")
    tokenizer.chat_template = template
    return tokenizer
