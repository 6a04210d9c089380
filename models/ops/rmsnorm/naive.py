"""Plain-torch RMSNorm over the last dim, optionally of a residual sum, as the decoders' pre-norms apply it.

Legend: ... leading dims (rows, heads), D normalised dim.
"""

import torch

from models.dtypes import upcast


def naive_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = s / rms(s) * scale with s = x (+ residual), scale = 1 + weight when `zero_centered` else weight.

    Args:
        x: `[..., D]`. weight: `[D]` (model dtype). residual: `[..., D]` in x.dtype, or None.
    Returns: (y `[..., D]` in x.dtype, s `[..., D]`): s is the residual sum rounded to x.dtype (x itself without a
        residual), the stream the decoder carries on.

    Rounding (transformers' order, bit for bit with `Qwen3NextRMSNorm`'s): the sum rounds to x.dtype first (as the
    decoders' `residual + hidden`), then upcast to fp32 (float64 stays float64), s * rsqrt(mean(s^2) + eps), times
    the upcast scale, one rounding to x.dtype. Kimi-Linear's `KimiLinearRMSNorm` rounds before the weight multiply;
    the two agree exactly in fp32 and to one rounding in bf16.
    """
    s = x if residual is None else x + residual
    dtype = upcast(s.dtype)
    h = s.to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    scale = 1.0 + weight.to(dtype) if zero_centered else weight.to(dtype)
    return (h * scale).to(s.dtype), s
