"""Gated RMSNorm: `gated_rms_norm` runs fla's `rms_norm_gated` on CUDA and `naive_rms_norm_gated` otherwise."""

from models.ops.dispatch import use_fla
from models.ops.norm.fused import rms_norm_gated
from models.ops.norm.naive import naive_rms_norm_gated


def gated_rms_norm(x, g, weight, eps=1e-6, activation="swish", *, round_normed_to_input_dtype=False):
    """Signature and returns of `models.ops.norm.naive.naive_rms_norm_gated`."""
    op = rms_norm_gated if use_fla(x) else naive_rms_norm_gated
    return op(x, g, weight, eps, activation, round_normed_to_input_dtype=round_normed_to_input_dtype)


__all__ = ["gated_rms_norm", "naive_rms_norm_gated", "rms_norm_gated"]
