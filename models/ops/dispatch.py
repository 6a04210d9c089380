"""Which implementation an op dispatcher runs: the Triton kernels (fla's, or the project's own for RMSNorm, the GLUs
and the MoE combine) for CUDA tensors, the plain-torch reference otherwise (CPU, and float64 anywhere: the kernels
are not float64). The row-wise ops take their kernels only where the caller asks for them (`use_fused_rowwise`):
a model passes its `models.ops.settings.KernelSettings.fused_rowwise`.
"""

import torch


def use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64


def use_fused_rowwise(x: torch.Tensor, fused: bool) -> bool:
    """The fused row-wise path for `x`: asked for (`fused`) and a tensor the kernels take."""
    return fused and use_fla(x)
