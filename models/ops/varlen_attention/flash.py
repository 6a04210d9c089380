"""Packed causal attention forward and backward as separate calls of torch's varlen FlashAttention-2 kernels
(`aten::_flash_attention_forward` / `_backward`; CUDA, bf16/fp16), for autograd Functions that must choose what to keep
between the two (`models.tree.branch_attention`, `function.py`). Signatures, layouts and the bottom-right causal
convention of `naive.py`; k/v heads may be fewer than q heads (FlashAttention's native GQA).

The kernels take one head dim for q, k and v: a smaller value head dim V (MLA: 128 against q/k 192) is zero-padded
to K here, in forward (v) and backward (v, dout, out), and the outputs are cut back to V. Zero columns of v give zero
columns of out, which add nothing to the backward's rowsum(dout * out), so the cut results equal an unpadded kernel's;
the padding costs (K - V) / V more value work and a copy of v per call."""

from __future__ import annotations

import torch

from models.ops.varlen_attention.kernel_args import int32_offsets, pad_to

__all__ = ["flash_varlen_forward", "flash_varlen_backward"]


def flash_varlen_forward(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """-> (out `[Q, H, V]`, lse: the kernel's float32 log-sum-exp, passed back unchanged to the backward)."""
    K, V = q_QHK.shape[-1], v_SGV.shape[-1]
    cu_q, cu_k = int32_offsets(cu_q), int32_offsets(cu_k)
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q_QHK, k_SGK, pad_to(v_SGV, K), cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    return (out[..., :V].contiguous() if V < K else out), lse


def flash_varlen_backward(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k, max_q: int, max_k: int,
                          scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, V]`)."""
    K, V = q_QHK.shape[-1], v_SGV.shape[-1]
    # Without dropout the kernel never reads its philox state; placeholders as in torch.nn.attention.varlen.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q_QHK.device)
    unused = torch.empty(0, device=q_QHK.device)
    cu_q, cu_k = int32_offsets(cu_q), int32_offsets(cu_k)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        pad_to(dout_QHV, K).contiguous(), q_QHK, k_SGK, pad_to(v_SGV, K), pad_to(out_QHV, K), lse, cu_q, cu_k,
        max_q, max_k, 0.0, True, rng_state, unused, scale=scale,
    )
    return dq, dk, dv[..., :V]
