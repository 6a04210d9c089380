"""ModelConfig <-> Hugging Face config.json for Qwen3NextForCausalLM and KimiLinearForCausalLM.

Reading goes through transformers' own config classes (`Qwen3NextConfig`, `KimiLinearConfig`), so defaults and
backward-compatible spellings are resolved exactly as transformers resolves them. Writing produces what both
transformers 5 and vLLM read: for Kimi-Linear the Moonshot layout (`linear_attn_config`, `first_k_dense_replace`,
`num_experts`, `mla_use_nope`, ...) that vLLM's own `KimiLinearConfig` requires and transformers maps onto its fields.
"""

from __future__ import annotations

from typing import Any

from models.config import (
    DenseFFNConfig,
    GatedAttentionConfig,
    GDNConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)

ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next", "KimiLinearForCausalLM": "kimi_linear"}


def _unsupported(field: str, value: Any, why: str) -> NotImplementedError:
    return NotImplementedError(f"config.json `{field}` = {value!r} is not supported: {why}")


def architecture_of(raw: dict) -> str:
    """The supported architecture named in a config.json dict, or NotImplementedError."""
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise NotImplementedError(
        f"config.json `architectures` = {archs!r}: only {sorted(ARCHITECTURES)} can be loaded"
    )


def _common(cfg) -> dict:
    if cfg.hidden_act != "silu":
        raise _unsupported("hidden_act", cfg.hidden_act, "only silu (SwiGLU) is implemented")
    if getattr(cfg, "attention_bias", False):
        raise _unsupported("attention_bias", True, "attention projections have no bias here")
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        layer_types=tuple(cfg.layer_types),
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        initializer_range=cfg.initializer_range,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def config_from_hf(raw: dict) -> ModelConfig:
    """ModelConfig of a Qwen3NextForCausalLM or KimiLinearForCausalLM config.json dict (dtype: float32; `load_hf`
    sets the checkpoint's)."""
    import transformers

    arch = architecture_of(raw)
    if arch == "Qwen3NextForCausalLM":
        cfg = transformers.Qwen3NextConfig.from_dict(raw)
        rope = dict(cfg.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise _unsupported("rope_parameters.rope_type", rope.get("rope_type"), "only default RoPE is implemented")
        if cfg.num_experts > 0 and cfg.shared_expert_intermediate_size <= 0:
            raise _unsupported("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                               "Qwen3-Next MoE layers always have a gated shared expert")
        ffn_types = tuple(
            "moe" if i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
            else "dense"
            for i in range(cfg.num_hidden_layers)
        )
        return ModelConfig(
            family="qwen3_next",
            ffn_types=ffn_types,
            full_attention=GatedAttentionConfig(
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                rope_theta=float(rope["rope_theta"]),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            ),
            linear_attention=GDNConfig(
                num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim,
                conv_size=cfg.linear_conv_kernel_dim,
            ),
            dense_ffn=DenseFFNConfig(intermediate_size=cfg.intermediate_size),
            moe=MoEConfig(
                num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                expert_intermediate_size=cfg.moe_intermediate_size, score_func="softmax",
                norm_topk_prob=bool(cfg.norm_topk_prob),
                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True,
            ) if cfg.num_experts > 0 else None,
            zero_centered_norm=True,
            **_common(cfg),
        )

    cfg = transformers.KimiLinearConfig.from_dict(raw)
    activation = raw.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise _unsupported("moe_router_activation_func", activation, "transformers' KimiLinear routes with sigmoid")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise _unsupported("num_key_value_heads", cfg.num_key_value_heads,
                           "MLA decompresses one key/value per head: use num_attention_heads "
                           f"({cfg.num_attention_heads})")
    uses_moe = "sparse" in cfg.mlp_layer_types
    return ModelConfig(
        family="kimi_linear",
        ffn_types=tuple("moe" if t == "sparse" else "dense" for t in cfg.mlp_layer_types),
        full_attention=MLAConfig(
            num_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            # transformers always runs NoPE; vLLM (and Moonshot's code) rotate unless `mla_use_nope` is true, so an
            # explicit false means RoPE.
            rope=raw.get("mla_use_nope") is False,
            rope_theta=float(raw.get("rope_theta", 10_000.0)),
        ),
        linear_attention=KDAConfig(
            num_heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim, conv_size=cfg.linear_conv_kernel_dim
        ),
        dense_ffn=DenseFFNConfig(intermediate_size=cfg.intermediate_size),
        moe=MoEConfig(
            num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
            expert_intermediate_size=cfg.moe_intermediate_size, score_func="sigmoid",
            norm_topk_prob=bool(cfg.norm_topk_prob), routed_scaling_factor=float(cfg.routed_scaling_factor),
            num_groups=cfg.n_group, topk_groups=cfg.topk_group, expert_bias=True,
            shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        ) if uses_moe else None,
        zero_centered_norm=False,
        **_common(cfg),
    )


def _require(config: ModelConfig, field: str, ok: bool, why: str) -> None:
    if not ok:
        raise NotImplementedError(f"`ModelConfig.{field}` cannot be written as {config.family}: {why}")


def config_to_hf(config: ModelConfig) -> dict:
    """config.json dict for `config` (its family's architecture), loadable by transformers 5 and vLLM."""
    import transformers

    c = config
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, initializer_range=c.initializer_range,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, hidden_act="silu",
        layer_types=list(c.layer_types),
    )
    dense = c.dense_ffn.intermediate_size if c.dense_ffn else None
    if c.family == "qwen3_next":
        fa, la, moe = c.full_attention, c.linear_attention, c.moe
        _require(c, "full_attention", fa is None or isinstance(fa, GatedAttentionConfig), "needs GatedAttentionConfig")
        _require(c, "linear_attention", la is None or isinstance(la, GDNConfig), "needs GDNConfig")
        _require(c, "zero_centered_norm", c.zero_centered_norm, "Qwen3-Next norms are zero-centred")
        _require(c, "moe", moe is None or (
            moe.score_func == "softmax" and moe.routed_scaling_factor == 1.0 and moe.num_groups == 1
            and not moe.expert_bias and moe.shared_expert_gate
        ), "Qwen3-Next routes with softmax, no scaling, groups or bias, and a gated shared expert")
        _require(c, "linear_attention.chunk_size", la is None or la.chunk_size == 64, "config.json has no chunk size")
        kwargs = dict(common, max_position_embeddings=c.max_position_embeddings)
        if dense is not None:
            kwargs["intermediate_size"] = dense
        if fa is not None:
            kwargs.update(num_attention_heads=fa.num_heads, num_key_value_heads=fa.num_kv_heads, head_dim=fa.head_dim,
                          rope_parameters={"rope_type": "default", "rope_theta": fa.rope_theta,
                                           "partial_rotary_factor": fa.partial_rotary_factor})
        if la is not None:
            kwargs.update(linear_num_key_heads=la.num_k_heads, linear_num_value_heads=la.num_v_heads,
                          linear_key_head_dim=la.head_k_dim, linear_value_head_dim=la.head_v_dim,
                          linear_conv_kernel_dim=la.conv_size)
        if moe is None:
            kwargs["num_experts"] = 0
        else:
            kwargs.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                          moe_intermediate_size=moe.expert_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                          shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                          decoder_sparse_step=1,
                          mlp_only_layers=[i for i, t in enumerate(c.ffn_types) if t == "dense"])
        hf = transformers.Qwen3NextConfig(**kwargs)
        hf.architectures = ["Qwen3NextForCausalLM"]
    else:
        fa, la, moe = c.full_attention, c.linear_attention, c.moe
        _require(c, "full_attention", fa is None or isinstance(fa, MLAConfig), "needs MLAConfig")
        _require(c, "linear_attention", la is None or isinstance(la, KDAConfig), "needs KDAConfig")
        _require(c, "zero_centered_norm", not c.zero_centered_norm, "Kimi-Linear norms scale by w")
        _require(c, "full_attention.latent_norm_eps", fa is None or fa.latent_norm_eps == 1e-6,
                 "transformers fixes the latent norm eps at 1e-6")
        _require(c, "linear_attention.chunk_size", la is None or la.chunk_size == 64, "config.json has no chunk size")
        first_k_dense = c.ffn_types.index("moe") if "moe" in c.ffn_types else c.num_layers
        _require(c, "ffn_types", all(t == "moe" for t in c.ffn_types[first_k_dense:]),
                 "Kimi-Linear has dense FFNs in the first layers only (`first_k_dense_replace`)")
        _require(c, "moe", moe is None or (
            moe.score_func == "sigmoid" and moe.expert_bias and not moe.shared_expert_gate
            and moe.shared_expert_intermediate_size % moe.expert_intermediate_size == 0
        ), "Kimi-Linear routes with sigmoid scores and expert bias, and has ungated shared experts of the expert width")
        kwargs = dict(common, model_max_length=c.max_position_embeddings, first_k_dense_replace=first_k_dense,
                      moe_layer_freq=1, num_nextn_predict_layers=0)
        if dense is not None:
            kwargs["intermediate_size"] = dense
        if fa is not None:
            kwargs.update(num_attention_heads=fa.num_heads, num_key_value_heads=fa.num_heads,
                          kv_lora_rank=fa.kv_lora_rank, q_lora_rank=fa.q_lora_rank,
                          qk_nope_head_dim=fa.qk_nope_head_dim, qk_rope_head_dim=fa.qk_rope_head_dim,
                          v_head_dim=fa.v_head_dim, mla_use_nope=not fa.rope, rope_theta=fa.rope_theta)
        if la is not None:
            kwargs.update(linear_head_dim=la.head_dim, linear_num_heads=la.num_heads,
                          linear_conv_kernel_dim=la.conv_size)
            kwargs["linear_attn_config"] = {
                "kda_layers": [i + 1 for i, t in enumerate(c.layer_types) if t == "linear_attention"],
                "full_attn_layers": [i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"],
                "num_heads": la.num_heads, "head_dim": la.head_dim, "short_conv_kernel_size": la.conv_size,
            }
        kwargs["mlp_layer_types"] = ["sparse" if t == "moe" else "dense" for t in c.ffn_types]
        if moe is not None:
            kwargs.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                          moe_intermediate_size=moe.expert_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                          routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.num_groups,
                          topk_group=moe.topk_groups,
                          n_shared_experts=moe.shared_expert_intermediate_size // moe.expert_intermediate_size,
                          moe_router_activation_func="sigmoid", use_grouped_topk=True, topk_method="noaux_tc")
        hf = transformers.KimiLinearConfig(**kwargs)
        hf.architectures = ["KimiLinearForCausalLM"]
    out = hf.to_dict()
    out["dtype"] = c.dtype
    return out
