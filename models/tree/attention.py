"""Full attention over compact tree rows: a query row sees exactly its path ancestors and itself.

Legend: C compact rows (in the physical order of the execution plan), H query heads, G key/value heads, K query/key
head dim, V value head dim, N branches (input sequences of the plan), A gathered ancestor-view rows.

Three interchangeable backends, selected by `backend`:
- "dense": boolean [C, C] mask from preorder ranks, explicit softmax (the CPU reference; O(C^2) memory).
- "flex": FlexAttention with an O(C) mask function (two int64 vectors captured) and block sparsity.
- "branch": HARTS's asymmetric packed Q/KV view (§4.2): per branch, queries are its own rows, keys/values are its
  gathered ancestor rows plus its own rows, causal aligned bottom-right (query i of a branch with h ancestors sees
  view rows j <= h + i); outputs land on the branch's own rows. Runs in groups of bounded view rows, regathering
  in backward (`models.tree.branch_attention`): on CUDA in bf16/fp16 flat execution's kernel pair
  (`models.ops.varlen_attention.varlen_kernels`: FlashAttention-2 or FlashAttention-4, the model's
  `KernelSettings.attention`), the reference kernels elsewhere.
Projections, norms and RoPE run once per compact row before this; gathers scatter-add their gradients back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from models.dtypes import upcast
from models.tree.branch_attention import BranchGroup, branch_attention

__all__ = ["TreeAttentionLayout", "tree_attention", "Backend"]

Backend = Literal["dense", "flex", "branch"]


@dataclass
class TreeAttentionLayout:
    """O(C) visibility metadata plus the branch views, on one device.

    pre [C + P]: preorder rank of each physical row; pre_end [C + P]: exclusive end of its subtree in preorder ranks,
    so row k is an ancestor-or-self of row q iff pre[k] <= pre[q] < pre_end[k].
    kv_index [A]: physical rows of the branch views, branch after branch (the branches own consecutive physical rows;
    each view holds the branch's ancestors root-first, then its own rows).
    groups: the branches split into consecutive kernel calls of bounded view rows (`branch_groups`).
    context_rows: P, key/value rows after the C physical rows that are no queries: the ancestors executed in earlier
        parts (prefix carry); the keys and values are then `[C + P]`, the queries `[C]`.
    """

    pre: torch.Tensor
    pre_end: torch.Tensor
    kv_index: torch.Tensor
    groups: list[BranchGroup]
    context_rows: int = 0
    _block_mask: object = field(default=None, init=False, repr=False)

    def block_mask(self):
        """FlexAttention BlockMask of the ancestor-or-self relation, built on first use and shared by every layer of
        the microbatch and its recomputation (compiled on CUDA: it never materialises C x C)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            pre, end = self.pre, self.pre_end

            def visible(b, h, q_idx, kv_idx):
                return (pre[kv_idx] <= pre[q_idx]) & (pre[q_idx] < end[kv_idx])

            rows = pre.shape[0]
            self._block_mask = create_block_mask(visible, None, None, rows - self.context_rows, rows, device=pre.device,
                                                 _compile=pre.is_cuda)
        return self._block_mask

    def dense_mask(self) -> torch.Tensor:
        """Boolean [C, C + P]: visible[q, k]."""
        pre_q = self.pre[: self.pre.shape[0] - self.context_rows, None]
        return (self.pre[None, :] <= pre_q) & (pre_q < self.pre_end[None, :])


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _dense(q, k, v, layout: TreeAttentionLayout, scale: float) -> torch.Tensor:
    dtype = upcast(q.dtype)
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


def tree_attention(
    q_CHK: torch.Tensor,
    k_CGK: torch.Tensor,
    v_CGV: torch.Tensor,
    layout: TreeAttentionLayout,
    scale: float,
    backend: Backend = "dense",
    pair: str = "flash",
) -> torch.Tensor:
    """Ancestor-or-self attention over compact rows; returns [C, H, V] in q's dtype.

    Args:
        q_CHK: [C, H, K] queries (already normed and rotated at the rows' original positions).
        k_CGK: [C + P, G, K] keys (P = layout.context_rows carried ancestor rows after the physical ones), G divides H.
        v_CGV: [C + P, G, V] values.
        layout: the microbatch's TreeAttentionLayout.
        scale: softmax scale.
        backend: "dense" (reference), "flex" or "branch" (see the module docstring).
        pair: the CUDA kernel pair "branch" runs (`branch_attention`).
    """
    if backend == "dense":
        return _dense(q_CHK, k_CGK, v_CGV, layout, scale)
    if backend == "flex":
        return _flex(q_CHK, k_CGK, v_CGV, layout, scale)
    if backend == "branch":
        return branch_attention(q_CHK, k_CGK, v_CGV, layout.kv_index, layout.groups, scale, pair)
    raise ValueError(f"`backend` must be 'dense', 'flex' or 'branch', got {backend!r}")
