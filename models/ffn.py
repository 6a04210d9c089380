"""SwiGLU feed-forward (dense FFN and shared expert). Legend: T tokens, D model dim, F hidden width."""

from __future__ import annotations

import torch
from torch import nn

from models.ops.glu import swiglu
from models.ops.settings import KernelSettings


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj x) * up_proj x), names as transformers' `Qwen3NextMLP` / `KimiLinearMLP`; the
    activation product is `models.ops.glu.swiglu` (one fused pass on CUDA unless `kernels.fused_rowwise` is off)."""

    kernels: KernelSettings = KernelSettings()
    """Which kernels its ops run (`models.ops.settings`); the model it belongs to sets it
    (`HybridForCausalLM.use_kernels`)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x_TD), self.up_proj(x_TD), fused=self.kernels.fused_rowwise))
