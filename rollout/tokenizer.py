"""A tiny character-level tokenizer that vLLM and transformers load from a local directory (no hub download).

Every printable ASCII character is one token; chat-format markers are single special tokens, so a turn like
`<|call|>12+7*3<|end|>` is 9 tokens. The vocabulary is padded with `<|reserved_i|>` tokens to a fixed size, so the
model's `vocab_size` equals `len(tokenizer)` and every id the policy can sample decodes to a string.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, fields

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["ChatFormat", "CHAT", "build_char_tokenizer"]


@dataclass(frozen=True)
class ChatFormat:
    """The special-token strings of the chat format shared by the tokenizer and the environments."""

    pad: str = "<|pad|>"
    unk: str = "<|unk|>"
    bos: str = "<|bos|>"
    eos: str = "<|eos|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    tool: str = "<|tool|>"
    call: str = "<|call|>"
    answer: str = "<|answer|>"
    end: str = "<|end|>"

    def specials(self) -> list[str]:
        return [getattr(self, f.name) for f in fields(self)]


CHAT = ChatFormat()

#: One token per character: digits, letters, punctuation, space and newline (96 characters).
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer(vocab_size: int = 128) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer; save it with `save_pretrained(dir)` next to a checkpoint.

    Args:
        vocab_size: total number of tokens (specials + characters + reserved padding); use it as the model's
            `vocab_size`.

    Returns:
        a `PreTrainedTokenizerFast` whose `eos_token` is `<|end|>` (the end of a turn: generation stops there).
    """
    specials = CHAT.specials()
    needed = len(specials) + len(CHARACTERS)
    if vocab_size < needed:
        raise ValueError(f"`vocab_size` must be at least {needed} (specials + characters), got {vocab_size}")
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - needed)]
    vocab = {token: i for i, token in enumerate([*specials, *CHARACTERS, *reserved])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=CHAT.unk))
    # Split every character into its own piece; specials are matched as whole added tokens before this runs.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([*specials, *reserved])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=CHAT.bos,
        eos_token=CHAT.end,
        unk_token=CHAT.unk,
        pad_token=CHAT.pad,
        clean_up_tokenization_spaces=False,
    )
