"""Rotary position embedding (rotate-half convention, optionally on the leading part of each head only).

Legend: T tokens, H heads, R rotary dims (even), K head dim.
"""

from __future__ import annotations

import torch

from models.dtypes import upcast


def rope_cos_sin(
    position_ids_T: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[T, R]` for integer positions `[T]`: angle_j = pos * theta^(-2j/R), duplicated over both halves.

    Angles are computed in fp32 (float64 for float64) and the results cast to `dtype`, as transformers' default
    RoPE does.
    """
    angle_dtype = upcast(dtype)
    exponents = torch.arange(0, rotary_dim, 2, device=position_ids_T.device).to(angle_dtype) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs_TR = position_ids_T.to(angle_dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs_TR, freqs_TR), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_THK: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate the leading R dims of every head of x `[T, H, K]` (K >= R); the other K - R dims pass unchanged."""
    R = cos_TR.shape[-1]
    x_rot, x_pass = x_THK[..., :R], x_THK[..., R:]
    x1, x2 = x_rot[..., : R // 2], x_rot[..., R // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rot = x_rot * cos_TR[:, None, :] + rotated * sin_TR[:, None, :]
    return torch.cat((x_rot, x_pass), dim=-1)
