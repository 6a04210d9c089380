"""RMSNorm variants of the two families, and the gated output norm of linear attention.

Legend: T tokens, D normalised dim, HV value heads, V value head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from models.ops import gated_rms_norm
from models.ops.rmsnorm import rms_norm
from models.ops.settings import KernelSettings


class RMSNorm(nn.Module):
    """y = s / rms(s) * scale of s = x (+ residual), computed in fp32 (float64 for float64) and cast back to x.dtype
    (`models.ops.rmsnorm`: a fused Triton pass on CUDA unless `kernels.fused_rowwise` is off, plain torch otherwise).

    scale = 1 + weight with weight initialised to 0 when `zero_centered` (Qwen3-Next's `Qwen3NextRMSNorm`), else
    weight initialised to 1 (Kimi-Linear's `KimiLinearRMSNorm`, which casts before multiplying by the weight; the two
    orders agree exactly in fp32 and to one rounding in bf16).
    """

    kernels: KernelSettings = KernelSettings()
    """Which kernels its ops run (`models.ops.settings`); the model it belongs to sets it
    (`HybridForCausalLM.use_kernels`)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(
        self, x_TD: torch.Tensor, residual_TD: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x `[..., D]` -> y `[..., D]`; with a residual `[..., D]` -> (y, s): the norm of s = x + residual (rounded
        to x.dtype, the stream the decoder carries on) and s itself."""
        y, s = rms_norm(x_TD, self.weight, self.eps, self.zero_centered, residual_TD,
                        fused=self.kernels.fused_rowwise)
        return y if residual_TD is None else (y, s)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """Per-head output norm of linear attention: y = x / rms(x) * weight * act(gate), act = silu ("swish",
    Qwen3-Next GDN) or sigmoid (Kimi-Linear KDA); weight initialised to 1. Calls `models.ops.gated_rms_norm`;
    `round_normed_to_input_dtype` reproduces Qwen3-Next's rounding of the normed x before the weight (see there)."""

    def __init__(self, dim: int, eps: float, activation: str, round_normed_to_input_dtype: bool):
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.round_normed_to_input_dtype = round_normed_to_input_dtype
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x_THV: torch.Tensor, gate_THV: torch.Tensor) -> torch.Tensor:
        """x, gate `[T, HV, V]` -> `[T, HV, V]` in x.dtype."""
        return gated_rms_norm(
            x_THV, gate_THV, self.weight, eps=self.eps, activation=self.activation,
            round_normed_to_input_dtype=self.round_normed_to_input_dtype,
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, activation={self.activation}"
