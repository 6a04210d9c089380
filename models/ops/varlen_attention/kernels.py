"""Which (forward, backward) kernel pair packed causal attention runs for a tensor: torch's varlen FlashAttention-2
for CUDA bf16/fp16 tensors, the plain-torch reference otherwise."""

import torch

from models.ops.varlen_attention.flash import flash_varlen_backward, flash_varlen_forward
from models.ops.varlen_attention.naive import naive_varlen_backward, naive_varlen_forward


def varlen_kernels(x: torch.Tensor):
    """(forward, backward) for tensors like `x`."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return flash_varlen_forward, flash_varlen_backward
    return naive_varlen_forward, naive_varlen_backward


def pads_values(x: torch.Tensor) -> bool:
    """Whether the kernel pair for tensors like `x` runs values at the query/key head dim (flash: a smaller V is
    zero-padded to K inside each call). A caller that gathers the values of many views from one tensor pads that
    tensor once instead (`models.tree.branch_attention`): padding each gathered view costs a copy of every view row."""
    return varlen_kernels(x)[0] is flash_varlen_forward
