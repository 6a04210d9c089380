"""Packed causal attention split into forward and backward kernel calls: torch's varlen FlashAttention-2 on CUDA in
bf16/fp16 (`flash.py`), the plain-torch reference otherwise (`naive.py`). `varlen_kernels(x)` picks the pair."""

import torch

from models.ops.varlen_attention.flash import flash_varlen_backward, flash_varlen_forward
from models.ops.varlen_attention.naive import naive_varlen_backward, naive_varlen_forward


def varlen_kernels(x: torch.Tensor):
    """(forward, backward) for tensors like `x`."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return flash_varlen_forward, flash_varlen_backward
    return naive_varlen_forward, naive_varlen_backward


__all__ = ["flash_varlen_backward", "flash_varlen_forward", "naive_varlen_backward", "naive_varlen_forward",
           "varlen_kernels"]
