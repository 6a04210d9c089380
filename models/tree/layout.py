"""Per-microbatch tensors that every layer of tree execution reads: built once from the packed batch and the plan.

Legend: C compact rows, N branches (input sequences: each is a path of rows, contiguous in physical order),
W conv width.
"""

from __future__ import annotations

import numpy as np
import torch

from models.tree.attention import TreeAttentionLayout
from planner.pack import CompactBatch

__all__ = ["ancestor_rows", "build_attention_layout", "conv_context_rows"]


def ancestor_rows(batch: CompactBatch, row: int) -> np.ndarray:
    """Compact rows of the path from the root to `row` (inclusive), root first; walks segments, not tokens."""
    if row < 0:
        return np.zeros(0, dtype=np.int64)
    parts = []
    g = int(batch.segment[row])
    parts.append(np.arange(batch.seg_offsets[g], row + 1))
    g = int(batch.seg_parent[g])
    while g >= 0:
        parts.append(np.arange(batch.seg_offsets[g], batch.seg_offsets[g + 1]))
        g = int(batch.seg_parent[g])
    return np.concatenate(parts[::-1])


def build_attention_layout(
    batch: CompactBatch, physical_to_compact: np.ndarray, cu_seqlens: np.ndarray, device=None
) -> TreeAttentionLayout:
    """TreeAttentionLayout for rows in physical order.

    Args:
        batch: the packed microbatch (compact rows in trie preorder).
        physical_to_compact: [C] compact row of each physical row.
        cu_seqlens: [N+1] branch boundaries in physical rows; each branch must be one path in position order.
    """
    physical_to_compact = np.asarray(physical_to_compact, dtype=np.int64)
    compact_to_physical = np.empty_like(physical_to_compact)
    compact_to_physical[physical_to_compact] = np.arange(physical_to_compact.size)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    views, kv_lengths = [], []
    for n in range(cu.size - 1):
        first = physical_to_compact[cu[n]]
        anc = compact_to_physical[ancestor_rows(batch, int(batch.parent[first]))]
        views.append(anc)
        views.append(np.arange(cu[n], cu[n + 1]))
        kv_lengths.append(anc.size + cu[n + 1] - cu[n])
    cu_kv = np.zeros(cu.size, dtype=np.int64)
    np.cumsum(kv_lengths, out=cu_kv[1:])
    as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
    return TreeAttentionLayout(
        pre=as_t(physical_to_compact),
        pre_end=as_t(batch.subtree_end[physical_to_compact]),
        cu_q=as_t(cu),
        kv_index=as_t(np.concatenate(views) if views else np.zeros(0, np.int64)),
        cu_kv=as_t(cu_kv),
        max_q=int(np.diff(cu).max(initial=0)),
        max_kv=int(max(kv_lengths, default=0)),
    )


def conv_context_rows(batch: CompactBatch, physical_to_compact: np.ndarray, cu_seqlens: np.ndarray, width: int) -> np.ndarray:
    """[N, W-1] physical rows of the W-1 path predecessors of each branch's first row, oldest first; -1 = none.

    A branch's short convolution reads these as its initial conv state, so its first rows see their true ancestors
    and never a neighbour in the packing.
    """
    physical_to_compact = np.asarray(physical_to_compact, dtype=np.int64)
    compact_to_physical = np.empty_like(physical_to_compact)
    compact_to_physical[physical_to_compact] = np.arange(physical_to_compact.size)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    out = np.full((cu.size - 1, width - 1), -1, dtype=np.int64)
    for n in range(cu.size - 1):
        r = int(batch.parent[physical_to_compact[cu[n]]])
        for j in range(width - 2, -1, -1):
            if r < 0:
                break
            out[n, j] = compact_to_physical[r]
            r = int(batch.parent[r])
    return out
