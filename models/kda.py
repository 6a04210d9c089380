"""Kimi Delta Attention mixer as in Kimi-Linear (`transformers.models.kimi_linear.KimiLinearDeltaAttention`).

Legend: T tokens, D model dim, H heads, K head dim (= V), C conv channels = 3 H K.

Parameters (transformers names): `q_proj`, `k_proj`, `v_proj` (D -> H K), `conv1d.weight` `[C, 1, W]` over
[q | k | v], `forget_gate.f_a_proj` (D -> K), `forget_gate.f_b_proj` (K -> H K), `forget_gate.dt_bias [H K]`,
`forget_gate.A_log [1, 1, H, 1]`, `b_proj` (D -> H), `g_a_proj` (D -> K), `g_b_proj` (K -> H K), `o_norm` (gated
RMSNorm over K, sigmoid gate), `o_proj`. Decay per channel: g = -exp(A_log_h) * softplus(f + dt_bias);
beta = sigmoid(b_proj x).

The six projections that read the layer input (q, k, v, f_a, g_a, b) run as one GEMM over their concatenated
weights `[3 H K + 2 K + H, D]` (ling-3-tiny: 6,416 x 1,536, 20 MB): the input is read once, its gradient is one
GEMM instead of six summed ones, and q|k|v is a column slice of the output instead of a concatenation. Each output
row is the same dot products as six separate GEMMs compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.config import KDAConfig
from models.linear_attention import CoreInputs, LinearAttention
from models.norms import GatedRMSNorm
from models.ops import kda_core, l2_norm
from models.ops.gate import kda_decay
from models.ops.kda.tree_calls import fla_kda_calls


@dataclass
class KDARows:
    """Step-1 output of `KimiDeltaAttention` (all per row)."""

    qkv: torch.Tensor
    """`[T, C]` q|k|v before the conv."""
    f: torch.Tensor
    """`[T, H K]` forget-gate projection before dt_bias and activation."""
    b: torch.Tensor
    """`[T, H]` pre-sigmoid beta."""
    gate: torch.Tensor
    """`[T, H, K]` output-gate input."""


class KDAForgetGate(nn.Module):
    """Holds the forget-gate parameters under transformers' names; `KimiDeltaAttention` runs it in steps 1 and 3."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int):
        super().__init__()
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fla's initialisation: A ~ U(1, 16); dt_bias = softplus^-1(dt), log dt ~ U(log 1e-3, log 1e-1)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class KimiDeltaAttention(LinearAttention):
    """Steps as in `models.linear_attention`."""

    def __init__(self, config: KDAConfig, hidden_size: int, eps: float):
        c = config
        HK = c.num_heads * c.head_dim
        super().__init__(3 * HK, c.conv_size, c.chunk_size)
        self.config = c
        self.q_proj = nn.Linear(hidden_size, HK, bias=False)
        self.k_proj = nn.Linear(hidden_size, HK, bias=False)
        self.v_proj = nn.Linear(hidden_size, HK, bias=False)
        self.forget_gate = KDAForgetGate(hidden_size, c.num_heads, c.head_dim)
        self.b_proj = nn.Linear(hidden_size, c.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, c.head_dim, bias=False)
        self.g_b_proj = nn.Linear(c.head_dim, HK, bias=False)
        self.o_norm = GatedRMSNorm(c.head_dim, eps, activation="sigmoid", round_normed_to_input_dtype=False)
        self.o_proj = nn.Linear(HK, hidden_size, bias=False)

    core_op = staticmethod(kda_core)
    calls_op = staticmethod(fla_kda_calls)

    def conv_groups(self) -> tuple[int, int, int]:
        HK = self.config.num_heads * self.config.head_dim
        return HK, HK, HK

    def project(self, x_TD: torch.Tensor) -> KDARows:
        """Step 1 (per row): x `[T, D]` -> `KDARows` (one GEMM: module docstring); qkv, b are column slices."""
        c = self.config
        T, HK, fg = x_TD.shape[0], c.num_heads * c.head_dim, self.forget_gate
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, fg.f_a_proj.weight,
                            self.g_a_proj.weight, self.b_proj.weight])
        qkv_TC, f_a, g_a, b = F.linear(x_TD, weight).split([3 * HK, c.head_dim, c.head_dim, c.num_heads], dim=-1)
        gate = self.g_b_proj(g_a).view(T, c.num_heads, c.head_dim)
        return KDARows(qkv_TC, fg.f_b_proj(f_a), b, gate)

    def activate(self, rows: KDARows, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> CoreInputs:
        """Step 3 (per row): split heads, L2-normalise q/k, per-channel g = -exp(A_log) softplus(f + dt_bias)
        (`models.ops.gate.kda_decay`, fp32), beta = sigmoid(b). `qkv`: the conv's q, k, v `[T, H K]`."""
        c = self.config
        T = qkv[0].shape[0]
        q, k, v = (t.reshape(T, c.num_heads, c.head_dim) for t in qkv)
        fg = self.forget_gate
        fused = self.kernels.fused_rowwise
        g_THK = kda_decay(rows.f.reshape(T, c.num_heads, c.head_dim), fg.A_log, fg.dt_bias, fused=fused)
        return CoreInputs(q=l2_norm(q, fused=fused), k=l2_norm(k, fused=fused), v=v, g=g_THK,
                          beta=torch.sigmoid(rows.b))

    def output(self, o_THK: torch.Tensor, rows: KDARows) -> torch.Tensor:
        """Step 5 (per row): gated RMSNorm with sigmoid(gate), then o_proj -> `[T, D]`."""
        return self.o_proj(self.o_norm(o_THK, rows.gate).reshape(o_THK.shape[0], -1))
