"""Hybrid-attention decoders (Qwen3-Next, Kimi-Linear, Ling-3-tiny), their ops, and Hugging Face checkpoint I/O."""

from models.config import (
    DenseFFNConfig,
    GatedAttentionConfig,
    GDNConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from models.decoder import CausalLMOutput, DecoderOutput, HybridForCausalLM
from models.hf_io import checkpoint_tensors, load_hf, save_hf
from models.moe import MoEStats, load_balancing_loss, router_z_loss
from models.presets import PRESETS, preset

__all__ = [
    "PRESETS",
    "CausalLMOutput",
    "DecoderOutput",
    "DenseFFNConfig",
    "GDNConfig",
    "GatedAttentionConfig",
    "HybridForCausalLM",
    "KDAConfig",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "MoEStats",
    "checkpoint_tensors",
    "load_balancing_loss",
    "load_hf",
    "preset",
    "router_z_loss",
    "save_hf",
]
