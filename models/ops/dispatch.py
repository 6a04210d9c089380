"""Which implementation an op dispatcher runs: fla's Triton kernels for CUDA tensors, the plain-torch reference
otherwise (CPU, and float64 anywhere: fla's kernels are not float64)."""

import torch


def use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64
