"""Plain-torch gated RMSNorm over the last dim (per head), as Qwen3-Next and Kimi-Linear apply it after the mixer.

Legend: ... leading dims (tokens, heads), D normalised dim (the value head dim).
"""

import torch
import torch.nn.functional as F

from models.dtypes import upcast

GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


def naive_rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    activation: str = "swish",
    *,
    round_normed_to_input_dtype: bool = False,
) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * weight * act(g), act = silu ("swish"/"silu") or sigmoid.

    Args:
        x: `[..., D]` mixer output. g: `[..., D]` gate pre-activation. weight: `[D]`.
        round_normed_to_input_dtype: False follows transformers' `KimiLinearRMSNormGated` (and fla's
            `FusedRMSNormGated`): everything in fp32, one rounding at the end. True follows
            `Qwen3NextRMSNormGated`, which rounds the normalised x to x.dtype before multiplying by `weight`.
            Both give identical results for fp32 inputs.

    Returns `[..., D]` in x.dtype. The operation order is transformers' (bit-for-bit in fp32): upcast, pow(2).mean,
    x * rsqrt(var + eps), weight * x, times act(g.float()), downcast. float64 inputs are computed in float64.
    """
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    if g.shape != x.shape:
        raise ValueError(f"`g` must have the shape of `x` {tuple(x.shape)}, got {tuple(g.shape)}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"`weight` must be [D] with D={x.shape[-1]}, got {tuple(weight.shape)}")
    dtype = upcast(x.dtype)
    input_dtype = x.dtype
    hidden = x.to(dtype)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if round_normed_to_input_dtype:
        hidden = weight * hidden.to(input_dtype)
    else:
        hidden = weight.to(dtype) * hidden
    gate = g.to(dtype)
    hidden = hidden * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))
    return hidden.to(input_dtype)
