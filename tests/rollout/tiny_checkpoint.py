"""A tiny random Qwen3-Next checkpoint with the character tokenizer, saved where vLLM can load it (no hub access)."""

from __future__ import annotations

import torch

from rollout.tokenizer import build_char_tokenizer
from tests.models.hf_oracle import random_hf_model, tiny_qwen3_next_config

#: Logit scale of the output head: random init gives near-uniform log-probs (all ~ -ln V), which would hide a wrong
#: weight load; scaled logits spread log-probs over several nats.
LM_HEAD_SCALE = 4.0


def tiny_qwen3_next(seed: int):
    """fp32 transformers model (3 GDN + 1 gated-attention layer, first FFN dense, 4 experts top-2, head_dim 64,
    vocabulary = the character tokenizer) whose weights are exactly representable in bf16, so vLLM (bf16) and an
    fp32 transformers forward hold identical weights and differ only in arithmetic."""
    tokenizer = build_char_tokenizer()
    config = tiny_qwen3_next_config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1, linear_num_value_heads=2, num_experts=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = random_hf_model(config, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def save_checkpoint(model, path) -> str:
    """save_pretrained with the character tokenizer beside the weights; returns the directory."""
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return str(path)
