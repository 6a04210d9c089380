"""Adding segment sums on CUDA: one Triton pass (`kernels.py`) reading each source row once.

Legend: R target rows, A source rows, U targets, F columns of a row.
Reference with the same signature: `models.ops.segment_sum.naive.naive_add_segment_sums` (the same fp32 sums and
one rounding per row; its order of addition within a row may differ).
"""

import torch
import triton

from models.ops.segment_sum import kernels
from models.ops.segment_sum.plan import SegmentPlan


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[N, *F]` (N > 0) as `[N, F]` with the last dim contiguous (a view where it can be)."""
    flat = t.reshape(t.shape[0], -1)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


@torch.compiler.disable
def fused_add_segment_sums(out: torch.Tensor, src: torch.Tensor, plan: SegmentPlan) -> None:
    """As `naive_add_segment_sums`; `out` must have contiguous rows (it is written in place)."""
    if out.shape[1:] != src.shape[1:]:
        raise ValueError(f"rows of `out` {tuple(out.shape)} and `src` {tuple(src.shape)} must have the same shape")
    U = plan.rows.numel()
    if not U:
        return
    out_RF, src_AF = out.view(out.shape[0], -1), _rows(src)
    F = out_RF.shape[1]
    kernels.add_segment_sums_kernel[(U, triton.cdiv(F, kernels.BLOCK_F))](
        out_RF, src_AF, plan.rows, plan.order, plan.offsets, out_RF.stride(0), src_AF.stride(0), F=F,
        BF=kernels.BLOCK_F, num_warps=kernels.NUM_WARPS,
    )
