"""Full attention over compact tree rows: a query row sees exactly its path ancestors and itself.

Legend: C compact rows (in the physical order of the execution plan), H query heads, G key/value heads, K query/key
head dim, V value head dim, N branches (input sequences of the plan), A gathered ancestor-view rows.

Three interchangeable backends, selected by `backend`:
- "dense": boolean [C, C] mask from preorder ranks, explicit softmax (the CPU reference; O(C^2) memory).
- "flex": FlexAttention with an O(C) mask function (two int64 vectors captured) and block sparsity.
- "branch": HARTS's asymmetric packed Q/KV view (§4.2): per branch, queries are its own rows, keys/values are its
  gathered ancestor rows plus its own rows, causal aligned bottom-right (query i of a branch with h ancestors sees
  view rows j <= h + i); outputs land on the branch's own rows. On CUDA in bf16/fp16 it runs torch's varlen flash
  kernel, elsewhere a per-branch reference.
Projections, norms and RoPE run once per compact row before this; gathers scatter-add their gradients back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from models.attention_core import varlen_flash_causal

__all__ = ["TreeAttentionLayout", "tree_attention", "Backend"]

Backend = Literal["dense", "flex", "branch"]


@dataclass
class TreeAttentionLayout:
    """O(C) visibility metadata plus the branch views, on one device.

    pre [C]: preorder rank of each physical row; pre_end [C]: exclusive end of its subtree in preorder ranks, so row k
    is an ancestor-or-self of row q iff pre[k] <= pre[q] < pre_end[k].
    cu_q [N+1]: branch n owns the physical rows [cu_q[n], cu_q[n+1]) (all rows, in order).
    kv_index [A]: physical rows of the branch views (ancestors root-first, then the branch's own rows);
    cu_kv [N+1]: view n is kv_index[cu_kv[n]:cu_kv[n+1]].
    """

    pre: torch.Tensor
    pre_end: torch.Tensor
    cu_q: torch.Tensor
    kv_index: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int
    _block_mask: object = field(default=None, init=False, repr=False)

    def block_mask(self):
        """FlexAttention BlockMask of the ancestor-or-self relation, built on first use and shared by every layer of
        the microbatch and its recomputation (compiled on CUDA: it never materialises C x C)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            pre, end = self.pre, self.pre_end

            def visible(b, h, q_idx, kv_idx):
                return (pre[kv_idx] <= pre[q_idx]) & (pre[q_idx] < end[kv_idx])

            C = pre.shape[0]
            self._block_mask = create_block_mask(visible, None, None, C, C, device=pre.device, _compile=pre.is_cuda)
        return self._block_mask

    def dense_mask(self) -> torch.Tensor:
        """Boolean [C, C]: visible[q, k]."""
        pre_q = self.pre[:, None]
        return (self.pre[None, :] <= pre_q) & (pre_q < self.pre_end[None, :])

    def to(self, device) -> "TreeAttentionLayout":
        return TreeAttentionLayout(
            self.pre.to(device), self.pre_end.to(device), self.cu_q.to(device), self.kv_index.to(device),
            self.cu_kv.to(device), self.max_q, self.max_kv,
        )


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _dense(q, k, v, layout: TreeAttentionLayout, scale: float) -> torch.Tensor:
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    H = q.shape[1]
    scores = torch.einsum("qhk,shk->hqs", q.to(dtype), _expand_heads(k, H).to(dtype)) * scale
    scores = scores.masked_fill(~layout.dense_mask(), float("-inf"))
    return torch.einsum("hqs,shv->qhv", torch.softmax(scores, dim=-1), _expand_heads(v, H).to(dtype)).to(q.dtype)


_compiled_flex = None


def _flex(q, k, v, layout: TreeAttentionLayout, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    H = q.shape[1]
    block = layout.block_mask()
    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    V = v.shape[-1]
    pad = q.shape[-1] - V
    v_in = F.pad(v, (0, pad)) if q.is_cuda and pad > 0 else v
    out = fn(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v_in.transpose(0, 1)[None],
        block_mask=block, scale=scale, enable_gqa=k.shape[1] != H,
    )
    return out[0].transpose(0, 1)[..., :V]


def _branch_reference(q, k_view, v_view, layout: TreeAttentionLayout, scale: float) -> torch.Tensor:
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    H = q.shape[1]
    out = torch.empty(q.shape[0], H, v_view.shape[-1], dtype=q.dtype, device=q.device)
    cu_q, cu_kv = layout.cu_q.tolist(), layout.cu_kv.tolist()
    for n in range(len(cu_q) - 1):
        q_n = q[cu_q[n] : cu_q[n + 1]].to(dtype)
        k_n = _expand_heads(k_view[cu_kv[n] : cu_kv[n + 1]], H).to(dtype)
        v_n = _expand_heads(v_view[cu_kv[n] : cu_kv[n + 1]], H).to(dtype)
        L, A = q_n.shape[0], k_n.shape[0]
        # Bottom-right causal: query i sees view rows j <= (A - L) + i.
        mask = torch.arange(A, device=q.device)[None, :] <= (A - L) + torch.arange(L, device=q.device)[:, None]
        s = torch.einsum("qhk,shk->hqs", q_n, k_n) * scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        out[cu_q[n] : cu_q[n + 1]] = torch.einsum("hqs,shv->qhv", p, v_n).to(q.dtype)
    return out


def tree_attention(
    q_CHK: torch.Tensor,
    k_CGK: torch.Tensor,
    v_CGV: torch.Tensor,
    layout: TreeAttentionLayout,
    scale: float,
    backend: Backend = "dense",
) -> torch.Tensor:
    """Ancestor-or-self attention over compact rows; returns [C, H, V] in q's dtype.

    Args:
        q_CHK: [C, H, K] queries (already normed and rotated at the rows' original positions).
        k_CGK: [C, G, K] keys, G divides H.
        v_CGV: [C, G, V] values.
        layout: the microbatch's TreeAttentionLayout.
        scale: softmax scale.
        backend: "dense" (reference), "flex" or "branch" (see the module docstring).
    """
    if backend == "dense":
        return _dense(q_CHK, k_CGK, v_CGV, layout, scale)
    if backend == "flex":
        return _flex(q_CHK, k_CGK, v_CGV, layout, scale)
    if backend == "branch":
        k_view, v_view = k_CGK[layout.kv_index], v_CGV[layout.kv_index]
        if q_CHK.is_cuda and q_CHK.dtype in (torch.bfloat16, torch.float16):
            return varlen_flash_causal(
                q_CHK, k_view, v_view, layout.cu_q, layout.cu_kv, layout.max_q, layout.max_kv, scale
            )
        return _branch_reference(q_CHK, k_view, v_view, layout, scale)
    raise ValueError(f"`backend` must be 'dense', 'flex' or 'branch', got {backend!r}")
