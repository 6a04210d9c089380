"""Short causal convolution: `short_conv` runs fla's `causal_conv1d` on CUDA and `naive_causal_conv1d` otherwise."""

from models.ops.conv.fused import causal_conv1d
from models.ops.conv.naive import naive_causal_conv1d
from models.ops.dispatch import use_fla


def short_conv(x, weight, bias=None, initial_state=None, output_final_state=False, activation=None, cu_seqlens=None):
    """Signature and returns of `models.ops.conv.naive.naive_causal_conv1d`."""
    op = causal_conv1d if use_fla(x) else naive_causal_conv1d
    return op(x, weight, bias, initial_state, output_final_state, activation, cu_seqlens)


__all__ = ["causal_conv1d", "naive_causal_conv1d", "short_conv"]
