"""Gated DeltaNet mixer as in Qwen3-Next (`transformers.models.qwen3_next.Qwen3NextGatedDeltaNet`).

Legend: T tokens, D model dim, C conv channels = 2 H K + HV V, H query/key heads, HV value heads, r = HV / H,
K/V key/value head dims.

Parameters (transformer names): `in_proj_qkvz` (D -> H (2K + 2rV), laid out per key head h as
[q_h | k_h | v_h (r V) | z_h (r V)]), `in_proj_ba` (D -> H 2r, per key head [b_h (r) | a_h (r)]), `conv1d.weight`
`[C, 1, W]` over [q | k | v], `dt_bias [HV]`, `A_log [HV]`, `norm` (gated RMSNorm over V, silu gate), `out_proj`.
Decay: g = -exp(A_log) * softplus(a + dt_bias) per value head and token; beta = sigmoid(b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GDNConfig
from models.dtypes import upcast
from models.linear_attention import CoreInputs, LinearAttention
from models.norms import GatedRMSNorm
from models.ops import gdn_core, l2_norm


@dataclass
class GDNRows:
    """Step-1 output of `GatedDeltaNet` (all per row)."""

    qkv: torch.Tensor
    """`[T, C]` q|k|v before the conv."""
    z: torch.Tensor
    """`[T, HV, V]` output-gate input."""
    b: torch.Tensor
    """`[T, HV]` pre-sigmoid beta."""
    a: torch.Tensor
    """`[T, HV]` decay input."""


class GatedDeltaNet(LinearAttention):
    """Steps as in `models.linear_attention`."""

    def __init__(self, config: GDNConfig, hidden_size: int, eps: float):
        c = config
        key_dim, value_dim = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
        super().__init__(2 * key_dim + value_dim, c.conv_size, c.chunk_size)
        self.config = c
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * c.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(c.num_v_heads))
        self.norm = GatedRMSNorm(c.head_v_dim, eps, activation="swish", round_normed_to_input_dtype=True)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' initialisation: dt_bias = 1, A ~ U(0.01, 16)."""
        with torch.no_grad():
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    core_op = staticmethod(gdn_core)

    def conv_groups(self) -> tuple[int, int, int]:
        c = self.config
        key_dim = c.num_k_heads * c.head_k_dim
        return key_dim, key_dim, c.num_v_heads * c.head_v_dim

    def project(self, x_TD: torch.Tensor) -> GDNRows:
        """Step 1 (per row): x `[T, D]` -> `GDNRows`."""
        c = self.config
        T, H, r = x_TD.shape[0], c.num_k_heads, c.num_v_heads // c.num_k_heads
        qkvz = self.in_proj_qkvz(x_TD).view(T, H, 2 * c.head_k_dim + 2 * r * c.head_v_dim)
        q, k, v, z = qkvz.split([c.head_k_dim, c.head_k_dim, r * c.head_v_dim, r * c.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x_TD).view(T, H, 2 * r).split([r, r], dim=-1)
        qkv_TC = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return GDNRows(qkv_TC, z.reshape(T, c.num_v_heads, c.head_v_dim), b.reshape(T, -1), a.reshape(T, -1))

    def activate(self, rows: GDNRows, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> CoreInputs:
        """Step 3 (per row): split heads, L2-normalise q/k, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
        `qkv`: the conv's q, k `[T, H K]` and v `[T, HV V]`."""
        c = self.config
        T = qkv[0].shape[0]
        q, k, v = qkv
        dtype = upcast(rows.a.dtype)
        g_THV = -self.A_log.to(dtype).exp() * F.softplus(rows.a.to(dtype) + self.dt_bias.to(dtype))
        return CoreInputs(
            q=l2_norm(q.reshape(T, c.num_k_heads, c.head_k_dim), fused=self.kernels.fused_rowwise),
            k=l2_norm(k.reshape(T, c.num_k_heads, c.head_k_dim), fused=self.kernels.fused_rowwise),
            v=v.reshape(T, c.num_v_heads, c.head_v_dim),
            g=g_THV,
            beta=torch.sigmoid(rows.b),
        )

    def output(self, o_THV: torch.Tensor, rows: GDNRows) -> torch.Tensor:
        """Step 5 (per row): gated RMSNorm with silu(z), then out_proj -> `[T, D]`."""
        return self.out_proj(self.norm(o_THV, rows.z).reshape(o_THV.shape[0], -1))
