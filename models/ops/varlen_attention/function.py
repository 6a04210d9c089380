"""Packed causal attention as one autograd Function over the kernel pair `varlen_kernels` picks, so flat execution
(`models.attention_core`) runs the same kernels as the tree's branch views (`models.tree.branch_attention`).

Legend: Q packed query rows, S packed key rows, H query heads, G key/value heads (G divides H), K query/key head dim,
V value head dim (V <= K)."""

from __future__ import annotations

import torch

from models.ops.varlen_attention.kernels import varlen_kernels

__all__ = ["varlen_attention"]


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q, max_k, scale, pair):
        forward_kernel, ctx.backward_kernel = varlen_kernels(q_QHK, pair)
        out_QHV, lse = forward_kernel(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q, max_k, scale)
        ctx.save_for_backward(q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k)
        ctx.sizes = (max_q, max_k, scale)
        return out_QHV

    @staticmethod
    def backward(ctx, dout_QHV):
        q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = ctx.backward_kernel(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k, *ctx.sizes)
        return dq, dk, dv, None, None, None, None, None, None


def varlen_attention(q_QHK: torch.Tensor, k_SGK: torch.Tensor, v_SGV: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, scale: float, pair: str = "flash") -> torch.Tensor:
    """Sequence n's queries `[cu_q[n], cu_q[n+1])` over its keys/values `[cu_k[n], cu_k[n+1])`, causal aligned
    bottom-right -> `[Q, H, V]` in q's dtype; differentiable in q, k and v.

    Args:
        q_QHK, k_SGK, v_SGV: packed queries, keys, values.
        cu_q, cu_k: int32/int64 `[N+1]` sequence offsets on q's device.
        max_q, max_k: the longest query and key sequence.
        scale: softmax scale.
        pair: the CUDA kernel pair (`varlen_kernels`; a model's `KernelSettings.attention`).

    Raises:
        ValueError: the key/value heads do not divide the query heads, or V > K.
    """
    H, G = q_QHK.shape[1], k_SGK.shape[1]
    if H % G or v_SGV.shape[1] != G:
        raise ValueError(f"key and value heads ({G}, {v_SGV.shape[1]}) must be equal and divide the query heads {H}")
    if v_SGV.shape[-1] > q_QHK.shape[-1]:
        raise ValueError(f"the value head dim {v_SGV.shape[-1]} must not exceed the query/key head dim "
                         f"{q_QHK.shape[-1]}")
    return _VarlenAttention.apply(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q, max_k, scale, pair)
