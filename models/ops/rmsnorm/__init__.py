"""RMSNorm (+ residual): `rms_norm` runs the Triton `fused_rms_norm` on CUDA when `fused` (a model's
`KernelSettings.fused_rowwise`), and `naive_rms_norm` otherwise."""

from models.ops.dispatch import use_fused_rowwise
from models.ops.rmsnorm.naive import naive_rms_norm


def rms_norm(x, weight, eps, zero_centered, residual=None, *, fused=True):
    """Signature and returns of `models.ops.rmsnorm.naive.naive_rms_norm`; `fused`: the kernel where it can run."""
    if use_fused_rowwise(x, fused):
        from models.ops.rmsnorm.fused import fused_rms_norm

        return fused_rms_norm(x, weight, eps, zero_centered, residual)
    return naive_rms_norm(x, weight, eps, zero_centered, residual)


__all__ = ["naive_rms_norm", "rms_norm"]
