"""Packed causal attention split into forward and backward kernel calls, and one autograd Function over them
(`function.varlen_attention`). Kernel pairs: torch's varlen FlashAttention-2 (`flash.py`) or FlashAttention-4
(`fa4.py`, optional package) on CUDA in bf16/fp16 (the caller names the pair, a model's `KernelSettings.attention`;
"auto" takes fa4 where it can run: `auto_cuda_attention`), the plain-torch reference (`naive.py`) otherwise.
`varlen_kernels(x, pair)` gives the pair for a tensor."""

from models.ops.varlen_attention.fa4 import fa4_varlen_backward, fa4_varlen_forward
from models.ops.varlen_attention.flash import flash_varlen_backward, flash_varlen_forward
from models.ops.varlen_attention.function import varlen_attention
from models.ops.varlen_attention.kernels import (
    ATTENTION_CHOICES,
    CUDA_ATTENTION,
    auto_cuda_attention,
    check_cuda_attention,
    pads_values,
    varlen_kernels,
)
from models.ops.varlen_attention.naive import naive_varlen_backward, naive_varlen_forward

__all__ = ["ATTENTION_CHOICES", "CUDA_ATTENTION", "auto_cuda_attention", "check_cuda_attention", "fa4_varlen_backward",
           "fa4_varlen_forward", "flash_varlen_backward", "flash_varlen_forward", "naive_varlen_backward",
           "naive_varlen_forward", "pads_values", "varlen_attention", "varlen_kernels"]
