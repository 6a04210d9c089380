"""Tiny random transformers models (Qwen3NextForCausalLM, KimiLinearForCausalLM) as CPU oracles.

transformers binds fla's Triton kernels when fla is importable, which fails on CPU; hiding fla while the modeling
modules load makes them bind their plain-torch fallbacks (see shared notes, environment.md).
"""

from __future__ import annotations

import sys

import torch


def transformers_cpu():
    """transformers with the Qwen3-Next and Kimi-Linear modeling modules bound to their torch fallbacks."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["fla"] = None
    try:
        import transformers

        # Touching the classes imports their modeling modules now, while fla is hidden.
        transformers.Qwen3NextForCausalLM, transformers.KimiLinearForCausalLM  # noqa: B018
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
    return transformers


def tiny_qwen3_next_config(**overrides):
    """4 layers (3 GDN + 1 gated attention), first FFN dense, 8 experts top-2; sizes as preset `tiny-qwen3-next`."""
    tf = transformers_cpu()
    kwargs = dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        max_position_embeddings=4096, attn_implementation="eager",
    )
    kwargs.update(overrides)
    return tf.Qwen3NextConfig(**kwargs)


def tiny_kimi_linear_config(**overrides):
    """4 layers (3 KDA + 1 MLA), first FFN dense, 8 experts top-2 in 2 groups; sizes as preset `tiny-kimi-linear`."""
    tf = transformers_cpu()
    kwargs = dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, linear_head_dim=64, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
        routed_scaling_factor=2.446, n_group=2, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        model_max_length=4096, attn_implementation="eager",
    )
    kwargs.update(overrides)
    return tf.KimiLinearConfig(**kwargs)


def random_hf_model(config, seed: int = 0):
    """A transformers model with random weights, in fp32, eval mode. Zero-initialised parameters that make some
    path trivial in transformers' init (zero-centred norm weights, expert biases) get random values too."""
    tf = transformers_cpu()
    torch.manual_seed(seed)
    cls = tf.Qwen3NextForCausalLM if config.model_type == "qwen3_next" else tf.KimiLinearForCausalLM
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model
