"""Packed causal attention forward and backward as separate calls of torch's varlen FlashAttention-2 kernels
(`aten::_flash_attention_forward` / `_backward`; CUDA, bf16/fp16), for autograd Functions that must choose what to keep
between the two (`models.tree.branch_attention`). Signatures, layouts and the bottom-right causal convention of
`naive.py`; k/v heads may be fewer than q heads (FlashAttention's native GQA)."""

from __future__ import annotations

import torch

__all__ = ["flash_varlen_forward", "flash_varlen_backward"]


def _cu(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 else x.to(torch.int32)


def flash_varlen_forward(q_QHK, k_SGK, v_SGK, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """-> (out `[Q, H, K]`, lse: the kernel's float32 log-sum-exp, passed back unchanged to the backward)."""
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q_QHK, k_SGK, v_SGK, _cu(cu_q), _cu(cu_k), max_q, max_k, 0.0, True, False, scale=scale
    )
    return out, lse


def flash_varlen_backward(dout_QHK, q_QHK, k_SGK, v_SGK, out_QHK, lse, cu_q, cu_k, max_q: int, max_k: int,
                          scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, K]`)."""
    # Without dropout the kernel never reads its philox state; placeholders as in torch.nn.attention.varlen.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q_QHK.device)
    unused = torch.empty(0, device=q_QHK.device)
    return torch.ops.aten._flash_attention_backward(
        dout_QHK.contiguous(), q_QHK, k_SGK, v_SGK, out_QHK, lse, _cu(cu_q), _cu(cu_k), max_q, max_k, 0.0, True,
        rng_state, unused, scale=scale,
    )
