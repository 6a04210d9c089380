"""Routed expert SwiGLU over rows sorted by expert: plain-torch reference and the grouped-GEMM CUDA path.

Legend: M routed (row, expert) pairs sorted by expert, D model dim, F expert hidden width, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.ops.glu import naive_swiglu, swiglu


def naive_expert_swiglu(
    x_MD: torch.Tensor, gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """Reference: for each expert e, rows `[offset_e, offset_e + counts_e)` of x go through
    down_e(silu(gate_e x) * up_e x), gate_e / up_e the first / second F rows of `gate_up_E2FD[e]`.

    Args:
        x_MD: `[M, D]` rows sorted by expert.
        gate_up_E2FD: `[E, 2F, D]` fused gate and up projections (transformers 5 layout).
        down_EDF: `[E, D, F]` down projections.
        counts_E: LongTensor `[E]` rows per expert, summing to M.
    Returns: `[M, D]` in x.dtype.
    """
    out = torch.empty_like(x_MD)
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n:
            gate, up = F.linear(x_MD[start : start + n], gate_up_E2FD[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(naive_swiglu(gate, up), down_EDF[e])
            start += n
    return out


def expert_swiglu(
    x_MD: torch.Tensor, gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, counts_E: torch.Tensor, *,
    fused: bool = True,
) -> torch.Tensor:
    """As `naive_expert_swiglu`; on CUDA in bf16 it runs `torch._grouped_mm` (one launch per projection) and the
    fused `swiglu` (where `fused`: a model's `KernelSettings.fused_rowwise`) on the two halves of the gate|up product
    (`models.ops.glu`, read in place)."""
    if not (x_MD.is_cuda and x_MD.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return naive_expert_swiglu(x_MD, gate_up_E2FD, down_EDF, counts_E)
    offsets = counts_E.cumsum(0).to(torch.int32)
    gate_up_M2F = torch._grouped_mm(x_MD, gate_up_E2FD.transpose(1, 2), offs=offsets)
    gate, up = gate_up_M2F.chunk(2, dim=-1)
    return torch._grouped_mm(swiglu(gate, up, fused=fused), down_EDF.transpose(1, 2), offs=offsets)
