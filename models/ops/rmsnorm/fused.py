"""Fused RMSNorm (+ residual) fast path (CUDA): one Triton pass forward, one backward (`kernels.py`).

Legend: ... leading dims, T rows (leading dims flattened), D normalised dim, P backward programs.
Reference with the same signature and returns: `models.ops.rmsnorm.naive.naive_rms_norm`.

Rounding: as the reference, the residual sum rounds to x.dtype (stored: it is the stream the decoder carries on)
and is normalised from that rounded value in fp32, times the fp32 scale, one rounding to x.dtype; the reference's
separate upcast, square, mean, rsqrt, multiply and downcast kernels become one pass with no fp32 tensor in memory.
It differs from the reference only by the order of the squares' sum. Backward: the gradient of s (from later
uses) is added in fp32 to the norm's gradient and rounded once (the reference adds the two rounded gradients).
"""

import torch
import triton

from models.ops.rmsnorm import kernels


def check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    D = x.shape[-1]
    if tuple(weight.shape) != (D,):
        raise ValueError(f"`weight` must be [D] with D={D}, got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"`residual` must match `x` {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )


class RMSNormFunction(torch.autograd.Function):
    """y (and s with a residual) from x `[T, D]`; the Function trusts `fused_rms_norm`'s checks."""

    @staticmethod
    def forward(ctx, x_TD, weight, residual_TD, eps, zero_centered):
        T, D = x_TD.shape
        y_TD = torch.empty_like(x_TD)
        s_TD = x_TD if residual_TD is None else torch.empty_like(x_TD)
        rstd_T = torch.empty(T, device=x_TD.device, dtype=torch.float32)
        BT = kernels.block_rows(D)
        if T:
            kernels.rms_norm_fwd_kernel[(triton.cdiv(T, BT),)](
                x_TD, residual_TD, s_TD, y_TD, weight, rstd_T, T, eps,
                D=D, BD=triton.next_power_of_2(D), BT=BT, HAS_RESIDUAL=residual_TD is not None,
                ZERO_CENTERED=zero_centered, num_warps=kernels.num_warps(D),
            )
        ctx.save_for_backward(s_TD, weight, rstd_T)
        ctx.zero_centered = zero_centered
        ctx.has_residual = residual_TD is not None
        return y_TD if residual_TD is None else (y_TD, s_TD)

    @staticmethod
    def backward(ctx, dy_TD, *ds):
        s_TD, weight, rstd_T = ctx.saved_tensors
        T, D = s_TD.shape
        ds_TD = ds[0].contiguous() if ctx.has_residual and ds[0] is not None else None
        dx_TD = torch.empty_like(s_TD)
        BT = kernels.block_rows(D)
        sms = torch.cuda.get_device_properties(s_TD.device).multi_processor_count
        # A multiple of BT, about two programs per SM: the dw partial sums stay small.
        rows_per_program = triton.cdiv(triton.cdiv(max(T, 1), 2 * sms), BT) * BT
        P = triton.cdiv(T, rows_per_program)
        dw_PD = torch.zeros(max(P, 1), D, device=s_TD.device, dtype=torch.float32)
        if T:
            kernels.rms_norm_bwd_kernel[(P,)](
                s_TD, weight, rstd_T, dy_TD.contiguous(), ds_TD, dx_TD, dw_PD, T, rows_per_program,
                D=D, BD=triton.next_power_of_2(D), BT=BT, HAS_DS=ds_TD is not None, ZERO_CENTERED=ctx.zero_centered,
                num_warps=kernels.num_warps(D),
            )
        dweight = dw_PD.sum(0).to(weight.dtype)
        return dx_TD, dweight, dx_TD if ctx.has_residual else None, None, None


@torch.compiler.disable
def fused_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `naive_rms_norm` (x, residual bf16/fp16/fp32 on CUDA)."""
    check(x, weight, residual)
    D = x.shape[-1]
    x_TD = x.reshape(-1, D).contiguous()
    if residual is None:
        return RMSNormFunction.apply(x_TD, weight.contiguous(), None, eps, zero_centered).view(x.shape), x
    res_TD = residual.reshape(-1, D).contiguous()
    y_TD, s_TD = RMSNormFunction.apply(x_TD, weight.contiguous(), res_TD, eps, zero_centered)
    return y_TD.view(x.shape), s_TD.view(x.shape)
