"""Presets and config validation: HF config.json round trips, published model sizes, HARTS Table 1."""

from __future__ import annotations

import json

import pytest
import torch

import models
from models.config import GDNConfig, KDAConfig, MoEConfig
from models.hf_config import config_from_hf, config_to_hf
from models.moe import MoE


@pytest.mark.parametrize("name", sorted(models.PRESETS))
def test_preset_config_json_round_trip(name):
    config = models.preset(name)
    again = config_from_hf(json.loads(json.dumps(config_to_hf(config))))
    again.dtype = config.dtype
    assert again == config


def _sizes(name: str) -> tuple[float, float]:
    """(total, active per token) parameter counts, built on the meta device."""
    config = models.preset(name)
    with torch.device("meta"):
        model = models.HybridForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()
                 for m in model.modules() if isinstance(m, MoE))
    return total, total - routed * (1 - config.moe.top_k / config.moe.num_experts)


@pytest.mark.parametrize("name, total_b, active_b", [("qwen3-next-80b-a3b", 80, 3.9), ("kimi-linear-48b-a3b", 48, 3.5)])
def test_published_presets_have_published_sizes(name, total_b, active_b):
    # Model cards: Qwen3-Next-80B-A3B "80B total, 3B activated" (3.9B counting embeddings and LM head);
    # Kimi-Linear-48B-A3B "48B total, 3B activated" (3.5B with embeddings).
    total, active = _sizes(name)
    assert abs(total / 1e9 / total_b - 1) < 0.05
    assert abs(active / 1e9 / active_b - 1) < 0.05


def test_ling_3_tiny_is_harts_table_1():
    c = models.preset("ling-3-tiny")
    assert c.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 6
    assert c.ffn_types == ("dense",) + ("moe",) * 23
    assert (c.hidden_size, c.full_attention.num_heads, c.dense_ffn.intermediate_size) == (1536, 16, 4608)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.expert_intermediate_size) == (128, 8, 512)
    assert isinstance(c.linear_attention, KDAConfig)
    assert (c.linear_attention.conv_size, c.linear_attention.chunk_size) == (4, 64)
    assert (c.vocab_size, c.dtype) == (157_184, "bfloat16")


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: GDNConfig(num_k_heads=3, num_v_heads=4, head_k_dim=64, head_v_dim=64), "num_v_heads"),
        (lambda: GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64, chunk_size=128), "chunk_size"),
        (lambda: KDAConfig(num_heads=4, head_dim=64, chunk_size=16), "chunk_size"),
        (lambda: MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=64, num_groups=3), "num_groups"),
        (lambda: MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=64, shared_expert_gate=True),
         "shared_expert_gate"),
        (lambda: models.ModelConfig(family="qwen3_next", vocab_size=8, hidden_size=8, layer_types=("full_attention",),
                                    ffn_types=("dense",)), "full_attention"),
        (lambda: models.ModelConfig(family="llama", vocab_size=8, hidden_size=8, layer_types=(), ffn_types=()),
         "family"),
    ],
)
def test_invalid_configs_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_unrepresentable_config_is_refused_by_config_to_hf():
    config = models.preset("tiny-qwen3-next")
    config.linear_attention = KDAConfig(num_heads=4, head_dim=64)
    with pytest.raises(NotImplementedError, match="linear_attention"):
        config_to_hf(config)


def test_vllm_reads_kimi_linear_config_json():
    # vLLM's own KimiLinearConfig (not transformers') decides KDA vs MLA layers, MoE and NoPE when serving; load its
    # module file directly, since importing the vllm package takes many seconds.
    import importlib.util
    import os

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "transformers_utils", "configs", "kimi_linear.py")
    module_spec = importlib.util.spec_from_file_location("vllm_kimi_linear_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = models.preset("kimi-linear-48b-a3b")
    vllm_config = module.KimiLinearConfig(**json.loads(json.dumps(config_to_hf(config))))
    kda = [vllm_config.is_kda_layer(i) for i in range(config.num_layers)]
    assert kda == [t == "linear_attention" for t in config.layer_types]
    assert vllm_config.mla_use_nope and vllm_config.is_moe
    routing = (vllm_config.num_experts, vllm_config.num_experts_per_token, vllm_config.first_k_dense_replace)
    assert routing == (256, 8, 1)
    assert vllm_config.moe_router_activation_func == "sigmoid" and vllm_config.routed_scaling_factor == 2.446


def test_first_layers_of_a_preset_keep_every_width():
    full, cut = models.preset("kimi-linear-48b-a3b"), models.preset("kimi-linear-48b-a3b", layers=8)
    assert cut.layer_types == full.layer_types[:8] and cut.ffn_types == full.ffn_types[:8]
    assert cut.layer_types.count("full_attention") == 2 and cut.ffn_types.count("moe") == 7
    assert (cut.hidden_size, cut.moe, cut.full_attention, cut.linear_attention) == (
        full.hidden_size, full.moe, full.full_attention, full.linear_attention)
    with pytest.raises(ValueError, match="`layers` must lie in 1..27"):
        models.preset("kimi-linear-48b-a3b", layers=28)
