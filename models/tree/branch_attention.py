"""HARTS's branch views (§4.2) as one autograd Function that keeps no gathered view between forward and backward.

Legend: C compact rows (physical order), H query heads, G key/value heads, K query/key head dim, V value head dim,
A view rows of one group.

Branch n's queries are its own rows; its keys/values are its ancestors' rows root-first, then its own rows (a view
gathered by `kv_index`), causal aligned bottom-right. Gathering every view at once costs A = (sum of branch path
lengths) rows of k and v, and autograd would keep them, and build their gradients, in every attention layer's
backward: on a 1% SWE step that is 5x the microbatch's own rows (about 4 GB per MLA layer of ling-3-tiny). Here the
branches run in consecutive groups whose views hold at most `max(C, longest view)` rows; the forward keeps only the
compact q/k/v, the output and the log-sum-exp, and the backward gathers each group's views again, runs the kernel's
backward and scatter-adds dk/dv onto the compact rows. Peak extra memory: one group's views and their gradients.

The scatter is a segment sum planned on the host (`models.ops.segment_sum`, `BranchGroup.sums`): a trunk row is in
every view of its group, and index_add_'s atomic adds on one address serialise, while
`index_put_(accumulate=True)` sorts the index on the device in every layer's backward; the planned segment sum is
faster than either (bench/RESULTS.md, "Profiled costs behind design choices"). The segment sum adds a row's
contributions in one pass in a fixed order, so dk/dv are deterministic and rounded once per group. A group whose
branches have no ancestors (`BranchGroup.own_rows`: every group of a flat expansion, and a group that happens to hold
only tree roots' first branches) reads its rows of k and v in place and adds their gradients, as flat attention
would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.ops.segment_sum import SegmentPlan, add_segment_sums
from models.ops.varlen_attention import pads_values, varlen_kernels
from models.ops.varlen_attention.kernel_args import pad_to
from models.tree.regions import region

__all__ = ["BranchGroup", "branch_attention", "branch_groups"]


@dataclass
class BranchGroup:
    """Consecutive branches run by one kernel call.

    rows: their query rows `[start, stop)` (physical order); kv: slice of the layout's `kv_index` with their views;
    cu_q / cu_kv [n+1]: group-local query and view offsets (int32, on the layout's device); max_q, max_kv: longest;
    own_rows: no branch of the group has ancestors, so its views are its query rows in order: the kernels read those
    rows of k and v in place and their gradients are added to them, with no gather and no scatter-add (every group
    of a flat expansion).
    sums: for a group that gathers, the order in which its view rows' dk/dv add to the compact rows (None for
    `own_rows`).
    """

    rows: slice
    kv: slice
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int
    own_rows: bool = False
    sums: SegmentPlan | None = None

def branch_groups(cu_q: np.ndarray, cu_kv: np.ndarray, max_view_rows: int, kv_index: np.ndarray
                  ) -> list[BranchGroup]:
    """Split branches (queries `cu_q`, views `cu_kv`, both [N+1] on the host) into consecutive groups whose views hold
    at most `max_view_rows` rows (a longer single view forms a group of its own); `kv_index` [A] is the layout's
    views on the host, from which each gathering group's gradient sums are planned. Host tensors
    (`models.tree.device_copy.to_device` moves them).

    The layout's contract (`models.tree.layout`, `models.tree.carry_microbatch_layout`): branch n's view in `kv_index`
    is its ancestors, then `arange(cu_q[n], cu_q[n+1])`, its own physical rows; so a group whose view offsets equal its
    query offsets (no ancestors) has its own query rows as its view (`own_rows`)."""
    groups, n, N = [], 0, cu_q.size - 1
    while n < N:
        m = n + 1
        while m < N and cu_kv[m + 1] - cu_kv[n] <= max_view_rows:
            m += 1
        q_off, kv_off = cu_q[n : m + 1] - cu_q[n], cu_kv[n : m + 1] - cu_kv[n]
        own_rows = bool(np.array_equal(q_off, kv_off))
        groups.append(BranchGroup(
            rows=slice(int(cu_q[n]), int(cu_q[m])),
            kv=slice(int(cu_kv[n]), int(cu_kv[m])),
            cu_q=torch.as_tensor(q_off, dtype=torch.int32),
            cu_kv=torch.as_tensor(kv_off, dtype=torch.int32),
            max_q=int(np.diff(q_off).max()),
            max_kv=int(np.diff(kv_off).max()),
            own_rows=own_rows,
            sums=None if own_rows else SegmentPlan(*(torch.as_tensor(a) for a in SegmentPlan.host_arrays(
                kv_index[int(cu_kv[n]) : int(cu_kv[m])]))),
        ))
        n = m
    return groups


def _views(g: BranchGroup, k_CGK: torch.Tensor, v_CGW: torch.Tensor, kv_index: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values `[A, G, K]`, `[A, G, W]`: its query rows in place when `own_rows`, else its
    gathered views."""
    if g.own_rows:
        return k_CGK[g.rows].contiguous(), v_CGW[g.rows].contiguous()  # views of contiguous rows: no copy
    with region("branch view gather"):
        view = kv_index[g.kv]
        return k_CGK[view], v_CGW[view]


def _gather_sources(k_CGK: torch.Tensor, v_CGW: torch.Tensor, groups: list[BranchGroup]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the views' gathers read them: contiguous when some group gathers. torch's row gather takes its
    vectorised kernel only for rows that are contiguous; MLA's values are a strided slice of `kv_b_proj`'s output, and
    their view gathers took the generic index kernel (with FlashAttention-4, which reads V = 128 unpadded: several
    times the larger keys' gathers; bench/RESULTS.md, "Profiled costs behind design choices"). One copy of the compact
    rows per pass costs much less than that."""
    if all(g.own_rows for g in groups):
        return k_CGK, v_CGW
    return k_CGK.contiguous(), v_CGW.contiguous()


class _BranchAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_CHK, k_CGK, v_CGV, kv_index, groups, scale, pair):
        forward_kernel, ctx.backward_kernel = varlen_kernels(q_CHK, pair)
        # Kernels that run values at the q/k head dim get them padded here once, not in every gathered view: the
        # views hold several times the compact rows. W is the width the kernels see (K when padded, else V).
        V = v_CGV.shape[-1]
        padded = pads_values(q_CHK, v_CGV, pair)
        k_src, v_CGW = _gather_sources(k_CGK, pad_to(v_CGV, q_CHK.shape[-1]) if padded else v_CGV, groups)
        out_CHW = q_CHK.new_empty(*q_CHK.shape[:2], v_CGW.shape[-1])
        lses = []
        for g in groups:
            k_view, v_view = _views(g, k_src, v_CGW, kv_index)
            with region("branch view attention"):
                out_CHW[g.rows], lse = forward_kernel(
                    q_CHK[g.rows], k_view, v_view, g.cu_q, g.cu_kv, g.max_q, g.max_kv, scale
                )
            lses.append(lse)
        ctx.save_for_backward(q_CHK, k_CGK, v_CGV, kv_index, out_CHW, *lses)
        ctx.groups, ctx.scale = groups, scale
        return out_CHW[..., :V].contiguous() if out_CHW.shape[-1] > V else out_CHW

    @staticmethod
    def backward(ctx, dout_CHV):
        q_CHK, k_CGK, v_CGV, kv_index, out_CHW, *lses = ctx.saved_tensors
        V, W = v_CGV.shape[-1], out_CHW.shape[-1]
        k_src, v_CGW = _gather_sources(k_CGK, pad_to(v_CGV, W), ctx.groups)
        dout_CHW = pad_to(dout_CHV, W).contiguous()
        dq, dk, dv = torch.empty_like(q_CHK), torch.zeros_like(k_CGK), torch.zeros_like(v_CGV)
        for g, lse in zip(ctx.groups, lses):
            k_view, v_view = _views(g, k_src, v_CGW, kv_index)
            with region("branch view attention backward"):
                dq[g.rows], dk_view, dv_view = ctx.backward_kernel(
                    dout_CHW[g.rows], q_CHK[g.rows], k_view, v_view, out_CHW[g.rows], lse,
                    g.cu_q, g.cu_kv, g.max_q, g.max_kv, ctx.scale,
                )
            if g.own_rows:
                dk[g.rows] += dk_view
                dv[g.rows] += dv_view[..., :V]
                continue
            with region("branch view scatter-add"):
                add_segment_sums(dk, dk_view, g.sums)
                add_segment_sums(dv, dv_view[..., :V], g.sums)
        return dq, dk, dv, None, None, None, None


def branch_attention(q_CHK: torch.Tensor, k_CGK: torch.Tensor, v_CGV: torch.Tensor, kv_index: torch.Tensor,
                     groups: list[BranchGroup], scale: float, pair: str = "flash") -> torch.Tensor:
    """Branch-view attention over compact rows -> `[C, H, V]` in q's dtype.

    Args:
        q_CHK, k_CGK, v_CGV: compact queries/keys/values (G divides H, V <= K).
        kv_index: [total view rows] physical rows of the views, branch after branch.
        groups: `branch_groups` of the microbatch.
        scale: softmax scale.
        pair: the CUDA kernel pair (`models.ops.varlen_attention.varlen_kernels`; the model's
            `KernelSettings.attention`, as flat execution's).
    """
    return _BranchAttention.apply(q_CHK, k_CGK, v_CGV, kv_index, groups, scale, pair)
