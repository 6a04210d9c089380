"""Plain-torch reference of adding segment sums.

Legend: R target rows, A source rows, U targets in the plan, F the trailing dims of a row.
"""

import torch

from models.ops.segment_sum.plan import SegmentPlan


def naive_add_segment_sums(out: torch.Tensor, src: torch.Tensor, plan: SegmentPlan) -> None:
    """out[rows[u]] += sum of src[order[offsets[u]:offsets[u+1]]], in place.

    Args:
        out: `[R, *F]`, its dtype kept.
        src: `[A, *F]` (any strides).
        plan: the host-built order (`SegmentPlan.host_arrays`).

    The sums run in fp32 (float64 for float64) and each target row is rounded once, after adding its old value."""
    acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    U = plan.rows.numel()
    segment = torch.repeat_interleave(torch.arange(U, device=src.device), plan.offsets.diff())
    sums = torch.zeros(U, *src.shape[1:], device=src.device, dtype=acc_dtype)
    sums.index_add_(0, segment, src[plan.order].to(acc_dtype))
    out[plan.rows] = (out[plan.rows].to(acc_dtype) + sums).to(out.dtype)
