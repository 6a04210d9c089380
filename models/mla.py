"""Multi-head latent attention as in Kimi-Linear (`transformers.models.kimi_linear.KimiLinearAttention`).

Legend: T tokens, D model dim, H heads, R kv latent width, Rq query latent width, N/P nope/rope part of a query-key
head, Kqk = N + P, V value head dim.

Each row is compressed to a key/value latent `[R]` (RMS-normed) plus one key part `[P]` shared by all heads;
per-head keys `[N]` and values `[V]` are decompressed from the latent, and the full key of head h is
`[k_nope_h | k_shared]`. Queries are `[q_nope_h | q_shared_h]`. With `rope` the P-dim parts of queries and the
shared key are rotated at the row's position; Kimi-Linear uses no RoPE (NoPE).

Parameter names follow transformers: `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`), `kv_a_proj_with_mqa`
(D -> R + P), `kv_a_layernorm`, `kv_b_proj` (R -> H * (N + V)), `o_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.attention_core import AttentionRows, attention
from models.config import MLAConfig
from models.norms import RMSNorm
from models.ops.settings import KernelSettings
from models.rope import apply_rope, rope_cos_sin


@dataclass
class MLALatents:
    """Per-row compressed state of MLA: what a KV cache or an ancestor-KV gather needs to keep."""

    q: torch.Tensor
    """`[T, H, Kqk]` queries (rotated if RoPE is on)."""
    kv_latent: torch.Tensor
    """`[T, R]` normed key/value latent."""
    k_shared: torch.Tensor
    """`[T, P]` key part shared by all heads (rotated if RoPE is on)."""


class MLA(nn.Module):
    """Steps: `latents` (per row) -> `decompress` (per row) -> `core` -> `output`. `project` = latents + decompress."""

    kernels: KernelSettings = KernelSettings()
    """Which kernels its ops run (`models.ops.settings`); the model it belongs to sets it
    (`HybridForCausalLM.use_kernels`)."""

    def __init__(self, config: MLAConfig, hidden_size: int, zero_centered_norm: bool):
        super().__init__()
        self.config = config
        c = config
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, c.num_heads * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.latent_norm_eps, zero_centered_norm)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.latent_norm_eps, zero_centered_norm)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, hidden_size, bias=False)
        self.scale = c.qk_head_dim**-0.5

    def latents(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor) -> MLALatents:
        """Per-row step: x `[T, D]`, positions `[T]` (used only with RoPE) -> queries and compressed keys/values."""
        c = self.config
        T = x_TD.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        q_THK = q.view(T, c.num_heads, c.qk_head_dim)
        kv_latent_TR, k_shared_TP = self.kv_a_proj_with_mqa(x_TD).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_latent_TR = self.kv_a_layernorm(kv_latent_TR)
        if c.rope:
            cos, sin = rope_cos_sin(position_ids_T, c.qk_rope_head_dim, c.rope_theta, x_TD.dtype)
            q_nope, q_rope = q_THK.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
            q_THK = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
            k_shared_TP = apply_rope(k_shared_TP[:, None, :], cos, sin)[:, 0]
        return MLALatents(q_THK, kv_latent_TR, k_shared_TP)

    def decompress(self, kv_latent_TR: torch.Tensor, k_shared_TP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row step: latent `[T, R]`, shared key `[T, P]` -> keys `[T, H, Kqk]`, values `[T, H, V]`."""
        c = self.config
        T = kv_latent_TR.shape[0]
        kv = self.kv_b_proj(kv_latent_TR).view(T, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope_THN, v_THV = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_THK = torch.cat((k_nope_THN, k_shared_TP[:, None, :].expand(-1, c.num_heads, -1)), dim=-1)
        return k_THK, v_THV

    def project(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor) -> AttentionRows:
        """Per-row step: `latents` then `decompress`; gate is None."""
        lat = self.latents(x_TD, position_ids_T)
        k, v = self.decompress(lat.kv_latent, lat.k_shared)
        return AttentionRows(lat.q, k, v)

    def core(self, q_QHK: torch.Tensor, k_SHK: torch.Tensor, v_SHV: torch.Tensor, mask) -> torch.Tensor:
        """softmax(q k^T / sqrt(Kqk)) v under `mask` -> `[Q, H, V]`."""
        return attention(q_QHK, k_SHK, v_SHV, mask, self.scale, self.kernels.attention)

    def output(self, o_THV: torch.Tensor, rows: AttentionRows) -> torch.Tensor:
        """Per-row step: o_proj of the concatenated heads -> `[T, D]`."""
        return self.o_proj(o_THV.reshape(o_THV.shape[0], -1))

    def forward(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor, mask) -> torch.Tensor:
        rows = self.project(x_TD, position_ids_T)
        return self.output(self.core(rows.q, rows.k, rows.v, mask), rows)
