"""Packed causal attention forward and backward as separate calls of FlashAttention-4's CuTe-DSL kernels (the
flash-attn-4 package, `flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd`; Hopper and Blackwell, bf16/fp16),
with the signatures, layouts and bottom-right causal convention of `naive.py` and `flash.py`.

Unlike `flash.py` the kernels take a value head dim V of their own (MLA: v 128 against q/k 192): nothing is padded.
The log-sum-exp is float32 `[H, Q]`, as flash's, and passes unchanged from the forward to the backward.
flash-attn-4 is imported on first call: the package is optional (`kernels.use_cuda_attention`)."""

from __future__ import annotations

import torch

from models.ops.varlen_attention.flash import int32_offsets

__all__ = ["fa4_varlen_forward", "fa4_varlen_backward", "fa4_interface"]


def fa4_interface():
    """flash-attn-4's interface module; raises RuntimeError naming why it cannot be imported."""
    try:
        from flash_attn.cute import interface
    except Exception as e:  # not installed, or its CUDA libraries fail to load (OSError and the like)
        raise RuntimeError(f"flash-attn-4 is not importable ({type(e).__name__}: {e}); install the flash-attn-4 "
                           "package or use the flash kernels") from None
    return interface


def fa4_varlen_forward(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """-> (out `[Q, H, V]`, lse `[H, Q]` float32)."""
    out, lse, *_ = fa4_interface()._flash_attn_fwd(
        q_QHK, k_SGK, v_SGV, cu_seqlens_q=int32_offsets(cu_q), cu_seqlens_k=int32_offsets(cu_k), max_seqlen_q=max_q,
        max_seqlen_k=max_k, softmax_scale=scale, causal=True, return_lse=True,
    )
    return out, lse


def fa4_varlen_backward(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k, max_q: int, max_k: int,
                        scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, V]`)."""
    dq, dk, dv = fa4_interface()._flash_attn_bwd(
        q_QHK, k_SGK, v_SGV, out_QHV, dout_QHV.contiguous(), lse, scale, True,
        cu_seqlens_q=int32_offsets(cu_q), cu_seqlens_k=int32_offsets(cu_k), max_seqlen_q=max_q, max_seqlen_k=max_k,
    )
    return dq, dk, dv
