"""Qwen3-Next full attention: GQA with a per-head sigmoid output gate, zero-centred q/k RMSNorm, partial RoPE.

Legend: T tokens, D model dim, H query heads, G key/value heads, K head dim, R rotary dims.

Parameter names follow `transformers.models.qwen3_next.Qwen3NextAttention`: `q_proj` (D -> H * 2K: per head the
query, then its gate), `k_proj`, `v_proj` (D -> G * K), `q_norm`, `k_norm` (over K), `o_proj` (H * K -> D).
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention_core import AttentionRows, attention
from models.config import GatedAttentionConfig
from models.norms import RMSNorm
from models.ops.glu import sigmoid_gate
from models.ops.settings import KernelSettings
from models.rope import apply_rope, rope_cos_sin


class GatedAttention(nn.Module):
    """Steps: `project` (per row: projections, q/k norm, RoPE at the given positions) -> `core` (attention under a
    mask description) -> `output` (sigmoid gate, o_proj). `forward` composes them."""

    kernels: KernelSettings = KernelSettings()
    """Which kernels its ops run (`models.ops.settings`); the model it belongs to sets it
    (`HybridForCausalLM.use_kernels`)."""

    def __init__(self, config: GatedAttentionConfig, hidden_size: int, eps: float, zero_centered_norm: bool):
        super().__init__()
        self.config = config
        H, G, K = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(hidden_size, H * K * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, G * K, bias=False)
        self.v_proj = nn.Linear(hidden_size, G * K, bias=False)
        self.o_proj = nn.Linear(H * K, hidden_size, bias=False)
        self.q_norm = RMSNorm(K, eps, zero_centered_norm)
        self.k_norm = RMSNorm(K, eps, zero_centered_norm)
        self.scale = K**-0.5

    def project(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor) -> AttentionRows:
        """Per-row step: x `[T, D]`, integer positions `[T]` -> q `[T, H, K]`, k, v `[T, G, K]`, gate `[T, H * K]`."""
        T = x_TD.shape[0]
        K = self.config.head_dim
        q_TH2K = self.q_proj(x_TD).view(T, -1, 2 * K)
        q_THK, gate_THK = q_TH2K.split(K, dim=-1)
        q_THK = self.q_norm(q_THK)
        k_TGK = self.k_norm(self.k_proj(x_TD).view(T, -1, K))
        v_TGK = self.v_proj(x_TD).view(T, -1, K)
        cos, sin = rope_cos_sin(position_ids_T, self.config.rotary_dim, self.config.rope_theta, x_TD.dtype)
        return AttentionRows(apply_rope(q_THK, cos, sin), apply_rope(k_TGK, cos, sin), v_TGK, gate_THK.reshape(T, -1))

    def core(self, q_QHK: torch.Tensor, k_SGK: torch.Tensor, v_SGK: torch.Tensor, mask) -> torch.Tensor:
        """softmax(q k^T / sqrt(K)) v under `mask` (see `models.attention_core`) -> `[Q, H, K]`."""
        return attention(q_QHK, k_SGK, v_SGK, mask, self.scale, self.kernels.attention)

    def output(self, o_THK: torch.Tensor, rows: AttentionRows) -> torch.Tensor:
        """Per-row step: o `[T, H, K]` * sigmoid(gate) -> o_proj -> `[T, D]`."""
        o_TX = sigmoid_gate(rows.gate, o_THK.reshape(o_THK.shape[0], -1), fused=self.kernels.fused_rowwise)
        return self.o_proj(o_TX)

    def forward(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor, mask) -> torch.Tensor:
        rows = self.project(x_TD, position_ids_T)
        return self.output(self.core(rows.q, rows.k, rows.v, mask), rows)
