"""Softmax attention core on packed rows, given a mask description.

Legend: Q query rows, S key rows, H query heads, G key/value heads (H % G == 0), K query/key head dim, V value head dim,
N packed sequences.

A mask description says which key rows each query row may see. It offers `dense()` (a boolean `[Q, S]` matrix, for
the plain-torch reference) and is matched by type to a fast kernel in `attention`. Flat packed training uses
`VarlenCausalMask`; tree execution adds its own description type (and, optionally, a fast kernel for it) here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from models.dtypes import upcast
from models.ops.varlen_attention import varlen_attention


@dataclass
class AttentionRows:
    """Per-row outputs of a full-attention mixer's projection step (step 1), the inputs of its core (step 2)."""

    q: torch.Tensor
    """`[T, H, K]` queries, normed and rotated as the mixer requires."""
    k: torch.Tensor
    """`[T, G, K]` keys."""
    v: torch.Tensor
    """`[T, G, V]` values."""
    gate: torch.Tensor | None = None
    """`[T, H * V]` pre-sigmoid output gate (gated GQA), or None."""


@dataclass(frozen=True)
class VarlenCausalMask:
    """Packed sequences, causal inside each, nothing across: query row i sees key row j iff both lie in the same
    sequence and j <= i. Queries and keys are the same T rows."""

    cu_seqlens: torch.Tensor
    """LongTensor `[N+1]`, sequence i is rows `[cu_seqlens[i], cu_seqlens[i+1])`."""

    @functools.cached_property
    def max_len(self) -> int:
        """Longest sequence (one host sync, on first use; every layer then reuses it)."""
        return int(self.cu_seqlens.diff().max())

    def dense(self) -> torch.Tensor:
        """Boolean `[T, T]`."""
        lengths = self.cu_seqlens.diff()
        seq_T = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
        rows = torch.arange(seq_T.numel(), device=lengths.device)
        return (seq_T[:, None] == seq_T[None, :]) & (rows[None, :] <= rows[:, None])


def naive_attention(
    q_QHK: torch.Tensor, k_SGK: torch.Tensor, v_SGV: torch.Tensor, mask_QS: torch.Tensor, scale: float
) -> torch.Tensor:
    """Reference: explicit softmax(scale * q k^T masked) v in fp32 (float64 for float64 inputs).

    Query head h reads key/value head h // (H // G). Every query row must see at least one key. Returns `[Q, H, V]`
    in q.dtype.
    """
    dtype = upcast(q_QHK.dtype)
    group = q_QHK.shape[1] // k_SGK.shape[1]
    k_SHK = k_SGK.to(dtype).repeat_interleave(group, dim=1)
    v_SHV = v_SGV.to(dtype).repeat_interleave(group, dim=1)
    scores_HQS = torch.einsum("qhk,shk->hqs", q_QHK.to(dtype), k_SHK) * scale
    scores_HQS = scores_HQS.masked_fill(~mask_QS, float("-inf"))
    probs_HQS = torch.softmax(scores_HQS, dim=-1)
    return torch.einsum("hqs,shv->qhv", probs_HQS, v_SHV).to(q_QHK.dtype)


def attention(
    q_QHK: torch.Tensor, k_SGK: torch.Tensor, v_SGV: torch.Tensor, mask, scale: float, pair: str = "flash"
) -> torch.Tensor:
    """Attention of q `[Q, H, K]` over k `[S, G, K]`, v `[S, G, V]` under `mask`; returns `[Q, H, V]` in q.dtype.

    `VarlenCausalMask` on CUDA in bf16/fp16 runs the packed kernels of `models.ops.varlen_attention` (CUDA pair
    `pair`, FlashAttention-2 or FlashAttention-4: the model's `KernelSettings.attention`, as in the tree's branch
    views); everything else runs `naive_attention` on `mask.dense()`.
    """
    if (
        isinstance(mask, VarlenCausalMask)
        and q_QHK.is_cuda
        and q_QHK.dtype in (torch.bfloat16, torch.float16)
    ):
        cu = mask.cu_seqlens
        return varlen_attention(q_QHK, k_SGK, v_SGV, cu, cu, mask.max_len, mask.max_len, scale, pair)
    return naive_attention(q_QHK, k_SGK, v_SGV, mask.dense(), scale)
