"""The character tokenizer: one id per character, chat markers as single ids, loadable from a saved directory."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rollout.tokenizer import CHARACTERS, CHAT, build_char_tokenizer


def test_round_trip_and_specials(tmp_path):
    tokenizer = build_char_tokenizer(vocab_size=160)
    assert len(tokenizer) == 160
    text = CHAT.bos + CHAT.user + CHARACTERS + CHAT.end + CHAT.assistant + "<|call|>(3+4)*5<|end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARACTERS) + 4 + 1 + len("(3+4)*5") + 1
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == CHAT.end
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids and loaded.eos_token_id == tokenizer.eos_token_id


def test_vocab_too_small():
    with pytest.raises(ValueError, match="`vocab_size` must be at least 106"):
        build_char_tokenizer(vocab_size=100)
