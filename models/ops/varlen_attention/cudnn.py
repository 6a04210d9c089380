"""Packed causal attention forward and backward as separate calls of cuDNN's ragged SDPA (`aten::_cudnn_attention_forward`
/ `_backward` with cumulative sequence offsets; CUDA, bf16/fp16, cuDNN >= 9). Signatures, layouts and the bottom-right
causal convention of `naive.py`; k/v heads may be fewer than q heads, and the value head dim V may differ from the
query/key head dim K (MLA's 128 against 192) with no padding.

torch 2.11 exposes these ops but no public varlen API over them (`torch.nn.attention.varlen` runs flash only, and
scaled_dot_product_attention on nested tensors takes cuDNN for head dims <= 128 with q, k and v equal)."""

from __future__ import annotations

import torch

from models.ops.varlen_attention.flash import int32_offsets

__all__ = ["cudnn_varlen_backward", "cudnn_varlen_forward", "cudnn_unavailable"]


def cudnn_unavailable() -> str | None:
    """Why this torch cannot run the cuDNN kernels here (None when it can)."""
    if not all(hasattr(torch.ops.aten, op) for op in ("_cudnn_attention_forward", "_cudnn_attention_backward")):
        return f"torch {torch.__version__} has no aten::_cudnn_attention_forward/_backward"
    if not torch.backends.cudnn.is_available():
        return "torch was built without cuDNN"
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return f"cuDNN {version} < 9.0 (ragged SDPA with separate q/k and v head dims)"
    return None


def _check() -> None:
    reason = cudnn_unavailable()
    if reason is not None:
        raise RuntimeError(f"attention backend 'cudnn': {reason}; use set_attention_backend('flash')")


def cudnn_varlen_forward(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """-> (out `[Q, H, V]`, lse: cuDNN's float32 softmax statistics, passed back unchanged to the backward)."""
    _check()
    out, lse, *_ = torch.ops.aten._cudnn_attention_forward(
        q_QHK, k_SGK, v_SGV, None, int32_offsets(cu_q), int32_offsets(cu_k), max_q, max_k, True, 0.0, True, False,
        scale=scale,
    )
    return out, lse


def cudnn_varlen_backward(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k, max_q: int, max_k: int,
                          scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, V]`)."""
    # Without dropout the kernel never reads the philox seed and offset.
    unused = torch.empty(0, device=q_QHK.device)
    return torch.ops.aten._cudnn_attention_backward(
        dout_QHV.contiguous(), q_QHK, k_SGK, v_SGV, out_QHV, lse, unused, unused, None, int32_offsets(cu_q),
        int32_offsets(cu_k), max_q, max_k, 0.0, True, scale=scale,
    )
