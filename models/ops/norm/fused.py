"""fla fast path for the gated RMSNorm (CUDA): `fla.modules.norm.fused_norm_gate.rms_norm_gated`.

Legend: ... leading dims, D normalised dim.
Reference with the same signature: `models.ops.norm.naive.naive_rms_norm_gated`.
"""

import torch

from models.ops.norm.naive import GATE_ACTIVATIONS


def rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    activation: str = "swish",
    *,
    round_normed_to_input_dtype: bool = False,
) -> torch.Tensor:
    """As `naive_rms_norm_gated`; fla computes in fp32 with one final rounding, so for bf16/fp16 inputs with
    `round_normed_to_input_dtype=True` (Qwen3-Next's order) it differs from transformers at rounding level.
    fla is imported here (slow import)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated

    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    if g.shape != x.shape:
        raise ValueError(f"`g` must have the shape of `x` {tuple(x.shape)}, got {tuple(g.shape)}")
    return fla_rms_norm_gated(x, g, weight, None, activation=activation, eps=eps)
