"""Fused L2 norm fast path (CUDA): one Triton pass forward, one backward (`kernels.py`).

Legend: ... leading dims, T rows (leading dims but the last flattened), H heads, K normalised dim.
Reference with the same signature: `models.ops.l2norm.naive.naive_l2_norm`.

The reference's upcast, square, sum, rsqrt, multiply and downcast kernels (and autograd's as many again backward,
with an fp32 copy of the input saved) become one pass each way with no fp32 tensor in memory: forward reads x and
writes y, backward reads x and dy and writes dx, recomputing the norm. Same fp32 formula and one rounding as the
reference; it differs only by the order of the squares' sum. A head-strided input (the q or k part of a q|k|v conv
output) is read in place.
"""

import torch
import triton
from torch.autograd.function import once_differentiable

from models.ops.l2norm import kernels


def _as_THK(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., H, K]` as `[T, H, K]` with unit stride along K: a view where the layout allows, else a copy."""
    x_THK = x.reshape(-1, *x.shape[-2:]) if x.dim() >= 2 else x.reshape(1, 1, -1)
    return x_THK if x_THK.stride(-1) == 1 or x_THK.shape[-1] == 1 else x_THK.contiguous()


def _launch(kernel, x_THK: torch.Tensor, *tensors: torch.Tensor, eps: float) -> None:
    T, H, K = x_THK.shape
    R, BR = T * H, kernels.block_rows(K)
    if R:
        kernel[(triton.cdiv(R, BR),)](x_THK, *tensors, R, H, x_THK.stride(0), x_THK.stride(1), eps, K=K,
                                      BK=triton.next_power_of_2(K), BR=BR, num_warps=kernels.num_warps(K))


class L2NormFunction(torch.autograd.Function):
    """y `[T, H, K]` (contiguous) from x `[T, H, K]` with unit stride along K."""

    @staticmethod
    def forward(ctx, x_THK, eps):
        y_THK = torch.empty(x_THK.shape, dtype=x_THK.dtype, device=x_THK.device)
        _launch(kernels.l2norm_fwd_kernel, x_THK, y_THK, eps=eps)
        ctx.save_for_backward(x_THK)
        ctx.eps = eps
        return y_THK

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_THK):
        (x_THK,) = ctx.saved_tensors
        dx_THK = torch.empty(x_THK.shape, dtype=x_THK.dtype, device=x_THK.device)
        _launch(kernels.l2norm_bwd_kernel, x_THK, dy_THK.contiguous(), dx_THK, eps=ctx.eps)
        return dx_THK, None


@torch.compiler.disable
def fused_l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As `naive_l2_norm` (bf16/fp16/fp32 on CUDA)."""
    return L2NormFunction.apply(_as_THK(x), float(eps)).view(x.shape)
