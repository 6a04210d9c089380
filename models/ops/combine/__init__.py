"""MoE combine: `moe_combine` runs the Triton `fused_moe_combine` on CUDA when `fused` (a model's
`KernelSettings.fused_rowwise`), and `naive_moe_combine` otherwise."""

from models.ops.combine.naive import naive_moe_combine
from models.ops.dispatch import use_fused_rowwise


def moe_combine(y_MD, slot_Tk, weights_Tk, *, fused=True):
    """Signature and returns of `models.ops.combine.naive.naive_moe_combine`; `fused`: the kernel where it can run."""
    if use_fused_rowwise(y_MD, fused):
        from models.ops.combine.fused import fused_moe_combine

        return fused_moe_combine(y_MD, slot_Tk, weights_Tk)
    return naive_moe_combine(y_MD, slot_Tk, weights_Tk)


__all__ = ["moe_combine", "naive_moe_combine"]
