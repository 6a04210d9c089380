"""bench.flops: the attention term of MFU is torchtitan's `12 l h q t` per token in its per-pair form, and MFU adds
it to `6 N` per row."""

from __future__ import annotations

import dataclasses

import pytest

from bench.flops import attention_flops_per_pair, mfu
from models.config import GatedAttentionConfig
from models.presets import preset


def test_attention_term_is_torchtitans_per_token_term_over_all_keys_of_a_sequence():
    """With d_qk = d_v = q, t queries against all t keys of a sequence are t^2 pairs; per token that is 12 l h q t."""
    config = preset("tiny-qwen3-next")
    config = dataclasses.replace(config, full_attention=GatedAttentionConfig(num_heads=4, num_kv_heads=2,
                                                                             head_dim=32))
    layers = sum(kind == "full_attention" for kind in config.layer_types)
    assert layers >= 1
    t = 1000
    per_token = attention_flops_per_pair(config) * t * t / t
    assert per_token == 12 * layers * 4 * 32 * t


def test_mla_pairs_count_the_rope_part_of_the_keys_and_the_value_width():
    """ling-3-tiny: 6 MLA layers, 16 heads, query-key width 128 + 64, value width 128."""
    assert attention_flops_per_pair(preset("ling-3-tiny")) == 6 * 16 * (128 + 64 + 128) * 6


def test_a_model_without_full_attention_has_no_attention_term():
    config = preset("tiny-qwen3-next")
    config = dataclasses.replace(config, layer_types=tuple("linear_attention" for _ in config.layer_types))
    assert attention_flops_per_pair(config) == 0


def test_mfu_adds_the_attention_term_to_six_per_parameter_and_row():
    assert mfu(10, 100, 0, 1e6, 2.0, 1e3) == pytest.approx(6 * 10 * 100 / 2.0 / 1e3)
    assert mfu(10, 100, 7, 1e6, 2.0, 1e3) == pytest.approx((6 * 10 * 100 + 7e6) / 2.0 / 1e3)
