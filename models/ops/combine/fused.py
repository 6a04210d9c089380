"""Fused MoE combine fast path (CUDA): one Triton pass per direction (`kernels.py`).

Legend: T rows, k experts per row, M = T k, D model dim.
Reference with the same signature: `models.ops.combine.naive.naive_moe_combine`.

Rounding: the k expert rows are loaded, multiplied by the fp32 weights and summed in fp32, one rounding to
y.dtype; the reference rounds the weights and each product to y.dtype first and materialises the `[T, k, D]`
gathered and weighted copies. Backward: dy = w dout rounded once per pair, dw in fp32 (the reference's dw is a
y.dtype product summed and rounded to y.dtype).
"""

import torch
import triton

from models.ops.combine import kernels


class MoECombineFunction(torch.autograd.Function):
    """`[M, D]` expert rows, `[T, k]` slots and weights -> `[T, D]`; trusts `fused_moe_combine`'s checks."""

    @staticmethod
    def forward(ctx, y_MD, slot_Tk, weights_Tk):
        (T, k), D = slot_Tk.shape, y_MD.shape[1]
        out_TD = torch.empty(T, D, device=y_MD.device, dtype=y_MD.dtype)
        if T:
            kernels.moe_combine_fwd_kernel[(T,)](
                y_MD, slot_Tk, weights_Tk, out_TD, D=D, K=k, BD=triton.next_power_of_2(D),
                num_warps=kernels.num_warps(D),
            )
        ctx.save_for_backward(y_MD, slot_Tk, weights_Tk)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        y_MD, slot_Tk, weights_Tk = ctx.saved_tensors
        (T, k), D = slot_Tk.shape, y_MD.shape[1]
        dy_MD = torch.empty_like(y_MD)
        dw_Tk = torch.empty(T, k, device=y_MD.device, dtype=torch.float32)
        if T:
            kernels.moe_combine_bwd_kernel[(T,)](
                y_MD, slot_Tk, weights_Tk, dout_TD.contiguous(), dy_MD, dw_Tk, D=D, K=k,
                BD=triton.next_power_of_2(D), num_warps=kernels.num_warps(D),
            )
        return dy_MD, None, dw_Tk.to(weights_Tk.dtype)


@torch.compiler.disable
def fused_moe_combine(y_MD: torch.Tensor, slot_Tk: torch.Tensor, weights_Tk: torch.Tensor) -> torch.Tensor:
    """As `naive_moe_combine` (y bf16/fp16/fp32 on CUDA)."""
    T, k = slot_Tk.shape
    if y_MD.dim() != 2 or y_MD.shape[0] != T * k or weights_Tk.shape != slot_Tk.shape:
        raise ValueError(
            f"`y_MD` must be [T k, D] and `weights_Tk` [T, k] for slots [T, k] = {tuple(slot_Tk.shape)}, got "
            f"{tuple(y_MD.shape)} and {tuple(weights_Tk.shape)}"
        )
    return MoECombineFunction.apply(y_MD.contiguous(), slot_Tk.contiguous(), weights_Tk.contiguous())
