"""Fused gated linear units (CUDA): SwiGLU silu(gate) * up and the sigmoid gate sigmoid(gate) * x, one Triton pass
forward and one backward (`kernels.py`).

Legend: ... any leading dims, R rows (leading dims flattened), D width.
References with the same signatures: `models.ops.glu.naive`. The kernels are elementwise, so a row's result never
depends on the other rows of the call. They compute in fp32 from the loaded values and round once (the references
round twice in bf16: after the activation and after the product); backward recomputes the activation from the saved
inputs, also in fp32 with one rounding per gradient. Row-strided inputs (the halves of a fused gate|up projection)
are read in place. Not traced by torch.compile (`parallel.config.compile`): the kernels are the fusion.
"""

import torch
import triton
from torch.autograd.function import once_differentiable

from models.ops.glu import kernels


def check(gate: torch.Tensor, other: torch.Tensor) -> None:
    if gate.shape != other.shape or gate.dtype != other.dtype:
        raise ValueError(
            f"`gate` {tuple(gate.shape)} {gate.dtype} and its partner {tuple(other.shape)} {other.dtype} must have "
            "one shape and dtype"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as `[R, D]` rows with unit column stride: a view where the layout allows (row-strided halves), else a
    copy."""
    t_RD = t.reshape(-1, t.shape[-1])
    return t_RD if t_RD.stride(-1) == 1 or t_RD.shape[-1] == 1 else t_RD.contiguous()


def _launch(kernel, *args, N: int, D: int, act: str) -> None:
    """`kernel` over N = R x D > 0 elements with its leading arguments `args` (tensors, then row strides)."""
    kernel[(triton.cdiv(N, kernels.BLOCK),)](*args, N, D=D, B=kernels.BLOCK, ACT=act, num_warps=kernels.NUM_WARPS)


class GLUFunction(torch.autograd.Function):
    """act(gate) * x `[..., D]` for `gate`, `x` `[..., D]` of one shape and dtype (the callers' `check`); act is
    "swish" or "sigmoid"."""

    @staticmethod
    def forward(ctx, gate, x, act: str):
        ctx.act, ctx.shape = act, gate.shape
        if gate.numel() == 0:
            ctx.save_for_backward(gate, x)
            return torch.empty_like(gate, memory_format=torch.contiguous_format)
        g_RD, x_RD = _rows(gate), _rows(x)
        R, D = g_RD.shape
        z_RD = torch.empty(R, D, dtype=gate.dtype, device=gate.device)
        _launch(kernels.glu_fwd_kernel, g_RD, x_RD, z_RD, g_RD.stride(0), x_RD.stride(0), N=R * D, D=D, act=act)
        ctx.save_for_backward(g_RD, x_RD)
        return z_RD.view(gate.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dz):
        g_RD, x_RD = ctx.saved_tensors
        if g_RD.numel() == 0:
            return torch.zeros_like(g_RD), torch.zeros_like(x_RD), None
        R, D = g_RD.shape
        dz_RD = dz.reshape(R, D).contiguous()
        dg_RD, dx_RD = torch.empty_like(dz_RD), torch.empty_like(dz_RD)
        _launch(kernels.glu_bwd_kernel, g_RD, x_RD, dz_RD, dg_RD, dx_RD, g_RD.stride(0), x_RD.stride(0), N=R * D, D=D,
                act=ctx.act)
        return dg_RD.view(ctx.shape), dx_RD.view(ctx.shape), None


@torch.compiler.disable
def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """As `naive_swiglu`."""
    check(gate, up)
    return GLUFunction.apply(gate, up, "swish")


@torch.compiler.disable
def fused_sigmoid_gate(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """As `naive_sigmoid_gate`."""
    check(gate, x)
    return GLUFunction.apply(gate, x, "sigmoid")
