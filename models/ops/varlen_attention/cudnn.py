"""Packed causal attention forward and backward as separate calls of cuDNN's ragged SDPA (`aten::_cudnn_attention_forward`
/ `_backward` with cumulative sequence offsets; CUDA, bf16/fp16, cuDNN >= 9). Signatures, layouts and the bottom-right
causal convention of `naive.py`; k/v heads may be fewer than q heads, and the value head dim V may differ from the
query/key head dim K (MLA's 128 against 192) with no padding.

torch 2.11 exposes these ops but no public varlen API over them (`torch.nn.attention.varlen` runs flash only, and
scaled_dot_product_attention on nested tensors takes cuDNN for head dims <= 128 with q, k and v equal).
On the H200 with torch 2.11 these ragged calls ran about 8x slower than flash on a 60,664-row flat microbatch
(models/ops/README.md, "Attention backends"): correct, not yet fast.

Its ragged causal mask is aligned top-left (on the H200 with torch 2.11 and cuDNN 9.19: query i of a sequence sees
keys j <= i whatever the key length), which equals bottom-right only when every sequence has as many keys as queries
(flat execution). For views with more keys than queries (the tree's branch views: h = len_k - len_q ancestor rows,
then the branch's own rows) the forward splits each sequence into its ancestors, which every query sees (one
non-causal call), and its own rows, a square causal block (one causal call), and merges the two partial results by
their log-sum-exps, out = sum_p exp(lse_p - lse) out_p with lse = logaddexp(lse_1, lse_2), summed in float32 from
the two bf16 partial outputs (so rounded twice; equal to the reference within bf16 on the H200). The matching backward (each part's backward given the merged out and lse) gave wrong dq/dk/dv
there in views of hundreds of ancestor rows (ancestors [40, 0, 287] under queries [50, 70, 13]: dv inf; the
forward of the same calls right; models/ops/README.md), so the backward of such views is refused with that reason
(`VIEWS_BACKWARD_LIMIT`): "cudnn" trains flat microbatches only. Every sequence needs len_k >= len_q (as the
reference's rows need a visible key), so total keys == total queries means every sequence is square.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.dtypes import upcast
from models.ops.varlen_attention.flash import int32_offsets

__all__ = ["VIEWS_BACKWARD_LIMIT", "cudnn_varlen_backward", "cudnn_varlen_forward", "cudnn_unavailable"]

VIEWS_BACKWARD_LIMIT = (
    "attention backend 'cudnn': the backward of views with more keys than queries (the tree's branch views) gave "
    "wrong gradients with torch 2.11's ragged cuDNN backward on the H200 (models/ops/README.md); use "
    "set_attention_backend('flash') (--attention-backend flash) for tree training"
)


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


def _forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    # The ragged graph addresses rows by each tensor's own strides, but torch allocates dv (and the output) packed:
    # a strided view (MLA's v is a split of one projection) must be packed first, or the backward writes dv with the
    # wrong layout without an error.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse, *_ = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale
    )
    return out, lse


def _split(cu_q: torch.Tensor, cu_k: torch.Tensor, Q: int, S: int):
    """-> (own [Q]: the key row on each query's diagonal; ancestors [S - Q]: the first len_k - len_q key rows of each
    sequence; their int32 offsets [N+1]; has_ancestors [Q, 1, 1]: the query's sequence has some), all on the device
    without a host sync."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    n = torch.arange(cu_q.numel() - 1, device=cu_q.device)
    lengths = cu_q.diff()
    h = cu_k.diff() - lengths
    seq_q = torch.repeat_interleave(n, lengths, output_size=Q)
    own = torch.arange(Q, device=cu_q.device) + (cu_k[1:] - cu_q[1:])[seq_q]
    cu_a = F.pad(h.cumsum(0), (1, 0))
    seq_a = torch.repeat_interleave(n, h, output_size=S - Q)
    ancestors = torch.arange(S - Q, device=cu_q.device) + (cu_k[:-1] - cu_a[:-1])[seq_a]
    return own, ancestors, cu_a.to(torch.int32), (h > 0)[seq_q][:, None, None]


def cudnn_varlen_forward(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """-> (out `[Q, H, V]`, lse `[Q, H, 1]` float32: cuDNN's softmax statistics, passed back unchanged to the
    backward)."""
    _check()
    Q, S = q_QHK.shape[0], k_SGK.shape[0]
    cu_q, cu_k = int32_offsets(cu_q), int32_offsets(cu_k)
    if S == Q:
        return _forward(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q, max_k, scale, True)
    own, ancestors, cu_a, has = _split(cu_q, cu_k, Q, S)
    out_own, lse_own = _forward(q_QHK, k_SGK[own], v_SGV[own], cu_q, cu_q, max_q, max_q, scale, True)
    out_anc, lse_anc = _forward(q_QHK, k_SGK[ancestors], v_SGV[ancestors], cu_q, cu_a, max_q, max_k, scale, False)
    lse_anc = lse_anc.masked_fill(~has, float("-inf"))
    lse = torch.logaddexp(lse_own, lse_anc)
    dt = upcast(q_QHK.dtype)
    out = out_own.to(dt) * (lse_own - lse).exp() + out_anc.to(dt).masked_fill(~has, 0.0) * (lse_anc - lse).exp()
    return out.to(q_QHK.dtype), lse


def cudnn_varlen_backward(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k, max_q: int, max_k: int,
                          scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, V]`); square sequences only (`VIEWS_BACKWARD_LIMIT`)."""
    if k_SGK.shape[0] != q_QHK.shape[0]:
        raise NotImplementedError(VIEWS_BACKWARD_LIMIT)
    # Without dropout the kernel never reads the philox seed and offset.
    unused = torch.empty(0, device=q_QHK.device)
    q_QHK, k_SGK, v_SGV, out_QHV = (x.contiguous() for x in (q_QHK, k_SGK, v_SGV, out_QHV))  # as in `_forward`
    return torch.ops.aten._cudnn_attention_backward(
        dout_QHV.contiguous(), q_QHK, k_SGK, v_SGV, out_QHV, lse, unused, unused, None, int32_offsets(cu_q),
        int32_offsets(cu_k), max_q, max_k, 0.0, True, scale=scale,
    )
