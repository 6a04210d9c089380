"""Packed causal attention split into forward and backward kernel calls, and one autograd Function over them
(`function.varlen_attention`). Kernel pairs: torch's varlen FlashAttention-2 (`flash.py`) on CUDA in bf16/fp16, the
plain-torch reference (`naive.py`) otherwise. `varlen_kernels(x)` picks the pair."""

from models.ops.varlen_attention.flash import flash_varlen_backward, flash_varlen_forward
from models.ops.varlen_attention.function import varlen_attention
from models.ops.varlen_attention.kernels import pads_values, varlen_kernels
from models.ops.varlen_attention.naive import naive_varlen_backward, naive_varlen_forward

__all__ = ["flash_varlen_backward", "flash_varlen_forward", "naive_varlen_backward", "naive_varlen_forward",
           "pads_values", "varlen_attention", "varlen_kernels"]
