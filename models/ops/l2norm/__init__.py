"""L2 norm over the last dim: `l2_norm` runs the Triton `fused_l2_norm` on CUDA when `fused` (a model's
`KernelSettings.fused_rowwise`), and `naive_l2_norm` otherwise."""

from models.ops.dispatch import use_fused_rowwise
from models.ops.l2norm.naive import naive_l2_norm


def l2_norm(x, eps=1e-6, *, fused=True):
    """Signature and returns of `models.ops.l2norm.naive.naive_l2_norm`; `fused`: the kernel where it can run."""
    if use_fused_rowwise(x, fused):
        from models.ops.l2norm.fused import fused_l2_norm

        return fused_l2_norm(x, eps)
    return naive_l2_norm(x, eps)


__all__ = ["l2_norm", "naive_l2_norm"]
