"""Arguments as the CUDA kernel pairs take them (`flash.py`, `fa4.py`): int32 sequence offsets, values zero-padded to
the query/key head dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["int32_offsets", "pad_to"]


def int32_offsets(cu: torch.Tensor) -> torch.Tensor:
    """Sequence offsets `[N+1]` as the kernels take them (int32)."""
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def pad_to(x: torch.Tensor, K: int) -> torch.Tensor:
    """x `[..., w]` zero-padded to `[..., K]` (x itself when w >= K)."""
    return F.pad(x, (0, K - x.shape[-1])) if x.shape[-1] < K else x
