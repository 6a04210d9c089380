"""Short causal conv of packed sequences that restart at zeros, with some rows recomputed from other history.

Legend: C rows, R extra source rows, X channels (in groups X_g), W width, N sequences, S rows of the recomputing
sequences, F recomputed rows.

Tree execution convolves each input sequence from its path's W-1 preceding rows, which lie elsewhere in the packing
(`models.tree.layout.conv_context_rows`). Passing them as fla's initial state runs the kernels' initial-state
variants, which cost more per row than flat's, forward and backward (an extra initial-state gradient kernel; the
profile: bench/RESULTS.md, "Profiled costs behind design choices"). Here
the sequences run as flat packing runs them (every sequence from zeros, the same kernels), and only each sequence's
first W-1 rows, the rows whose window reaches before its start, are recomputed: short sequences of [valid history
rows, first rows], gathered from `[x; extra]` and convolved from zeros, replace those rows' outputs. The values are
the same: each output row is the activation of a W-term product sum in a fixed order, whichever rows the kernel read
(`models.ops.conv.naive`; fla's kernel loads history from the state or from x alike).

Backward: the replaced rows' output gradients go to the short sequences, the rest to the big convolution (whose
windows at the replaced rows read the wrong history), and the short sequences' input gradients are added to the rows
they read. The fused path (`RecomputedRowsConv`: fla's `causal_conv1d_fwd`/`_bwd`) writes the replacements in place
and adds the short sequences' gradients into the big convolution's input gradient (no zero-filled `[C, X]` gradient
of a gather added to it); beyond flat's convolution it copies only each group's output gradient once, to zero the
recomputed rows' (the incoming gradient may be shared). `naive_conv_recomputed_rows` is the plain-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.ops.conv.naive import naive_causal_conv1d
from models.ops.dispatch import use_fla

__all__ = ["RecomputedRows", "conv_recomputed_rows", "naive_conv_recomputed_rows"]


@dataclass
class RecomputedRows:
    """Which rows a restarted convolution recomputes and from what (int64 index tensors on one device).

    rows [S]: rows of `[x; extra]` each recomputing sequence reads: its valid history rows, oldest first, then its
    own first rows; own_pos / own_rows: the positions among the S rows that read x, and those rows of x; extra_pos /
    extra_rows: the others, and the rows of extra they read. cu_seqlens [M+1] (and `cu_seqlens_cpu`): those
    sequences. keep [F]: positions among the S rows of the recomputed rows; target [F]: their rows of x.
    """

    rows: torch.Tensor
    own_pos: torch.Tensor
    own_rows: torch.Tensor
    extra_pos: torch.Tensor
    extra_rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    keep: torch.Tensor
    target: torch.Tensor

    @staticmethod
    def build(cu_seqlens: np.ndarray, history: np.ndarray) -> "RecomputedRows | None":
        """From the packing's sequences `cu_seqlens` [N+1] over the C rows of x and each sequence's history
        `[N, W-1]` (rows of `[x; extra]` preceding its first row, oldest first, -1 = none: a missing row is zeros).
        None when no sequence has history (a flat packing): the restarted convolution alone is exact. Host tensors
        (`models.tree.device_copy.to_device` moves them, `cu_seqlens_cpu` staying)."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        history = np.asarray(history, dtype=np.int64)
        rows, lengths, keep, target = [], [], [], []
        start = 0
        for n in np.flatnonzero((history >= 0).any(axis=1)):
            past = history[n][history[n] >= 0]
            first = np.arange(cu[n], min(cu[n] + history.shape[1], cu[n + 1]))
            if not first.size:
                continue
            rows.append(np.concatenate([past, first]))
            lengths.append(past.size + first.size)
            keep.append(start + past.size + np.arange(first.size))
            target.append(first)
            start += lengths[-1]
        if not rows:
            return None
        rows, C = np.concatenate(rows), int(cu[-1])
        own_pos, extra_pos = np.flatnonzero(rows < C), np.flatnonzero(rows >= C)
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
        cu_small = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
        return RecomputedRows(as_t(rows), as_t(own_pos), as_t(rows[own_pos]), as_t(extra_pos),
                              as_t(rows[extra_pos] - C), cu_small, cu_small, as_t(np.concatenate(keep)),
                              as_t(np.concatenate(target)))


def _source_rows(x_CX: torch.Tensor, extra_RX: torch.Tensor | None, fix: RecomputedRows) -> torch.Tensor:
    """`[x; extra][fix.rows]` -> `[S, X]`, without concatenating x and extra."""
    if not fix.extra_pos.numel():
        return x_CX[fix.rows]
    if extra_RX is None:
        raise ValueError("the recomputed rows read rows after x's: pass them as `extra`")
    small_SX = x_CX.new_empty(fix.rows.shape[0], x_CX.shape[1])
    small_SX[fix.own_pos] = x_CX[fix.own_rows]
    small_SX[fix.extra_pos] = extra_RX[fix.extra_rows]
    return small_SX


def naive_conv_recomputed_rows(x_CX: torch.Tensor, extra_RX: torch.Tensor | None, weight_XW: torch.Tensor,
                               groups: tuple[int, ...], cu_seqlens: torch.Tensor, fix: RecomputedRows
                               ) -> tuple[torch.Tensor, ...]:
    """Reference of `conv_recomputed_rows` (plain autograd over `naive_causal_conv1d`)."""
    outputs = []
    small_SX = _source_rows(x_CX, extra_RX, fix)
    for x_g, s_g, w_g in zip(x_CX.split(groups, dim=-1), small_SX.split(groups, dim=-1), weight_XW.split(groups)):
        y, _ = naive_causal_conv1d(x_g[None], w_g, activation="silu", cu_seqlens=cu_seqlens)
        y_small, _ = naive_causal_conv1d(s_g[None], w_g, activation="silu", cu_seqlens=fix.cu_seqlens)
        outputs.append(y[0].index_put((fix.target,), y_small[0, fix.keep]))
    return tuple(outputs)


class RecomputedRowsConv(torch.autograd.Function):
    """fla's kernels: the restarted convolution and the recomputing sequences per channel group (flat's kernel
    variants and tuned configs), replacements written in place."""

    @staticmethod
    def forward(ctx, x_CX, extra_RX, weight_XW, groups, cu_seqlens, fix):
        from fla.modules.causal_conv1d.ops import _has_non_standard_layout, causal_conv1d_fwd

        small_SX = _source_rows(x_CX, extra_RX, fix)
        outputs = []
        for x_g, s_g, w_g in zip(x_CX.split(groups, dim=-1), small_SX.split(groups, dim=-1), weight_XW.split(groups)):
            y, _ = causal_conv1d_fwd(x_g[None], w_g, None, None, activation="silu", cu_seqlens=cu_seqlens,
                                     layout_fallback=_has_non_standard_layout(x_g[None]))
            y_small, _ = causal_conv1d_fwd(s_g[None], w_g, None, None, activation="silu",
                                           cu_seqlens=fix.cu_seqlens, cu_seqlens_cpu=fix.cu_seqlens_cpu)
            y[0, fix.target] = y_small[0, fix.keep]
            outputs.append(y[0])
        ctx.save_for_backward(x_CX, small_SX, weight_XW)
        ctx.groups, ctx.cu_seqlens, ctx.fix = groups, cu_seqlens, fix
        ctx.extra_rows = None if extra_RX is None else extra_RX.shape[0]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *dy):
        from fla.modules.causal_conv1d.ops import _has_non_standard_layout, causal_conv1d_bwd

        x_CX, small_SX, weight_XW = ctx.saved_tensors
        fix, groups = ctx.fix, ctx.groups
        dx, dsmall, dw = [], [], []
        for dy_g, x_g, s_g, w_g in zip(dy, x_CX.split(groups, dim=-1), small_SX.split(groups, dim=-1),
                                       weight_XW.split(groups)):
            dy_small = dy_g.new_zeros(s_g.shape)
            dy_small[fix.keep] = dy_g[fix.target]
            dy_big = dy_g.index_fill(0, fix.target, 0)  # a copy: the incoming gradient may be shared
            dx_g, dw_g, *_ = causal_conv1d_bwd(x=x_g[None], dy=dy_big[None], dht=None, weight=w_g, activation="silu",
                                               cu_seqlens=ctx.cu_seqlens,
                                               layout_fallback=_has_non_standard_layout(x_g[None]))
            ds_g, dws_g, *_ = causal_conv1d_bwd(x=s_g[None], dy=dy_small[None], dht=None, weight=w_g,
                                                activation="silu", cu_seqlens=fix.cu_seqlens,
                                                cu_seqlens_cpu=fix.cu_seqlens_cpu)
            dx.append(dx_g[0])
            dsmall.append(ds_g[0])
            dw.append(dw_g + dws_g)
        dx_CX = torch.cat(dx, dim=-1)
        dsmall_SX = torch.cat(dsmall, dim=-1)
        dx_CX.index_put_((fix.own_rows,), dsmall_SX[fix.own_pos], accumulate=True)
        dextra = None
        if ctx.extra_rows is not None:
            dextra = dx_CX.new_zeros(ctx.extra_rows, dx_CX.shape[1])
            dextra.index_put_((fix.extra_rows,), dsmall_SX[fix.extra_pos], accumulate=True)
        return dx_CX, dextra, torch.cat(dw), None, None, None


def conv_recomputed_rows(x_CX: torch.Tensor, extra_RX: torch.Tensor | None, weight_XW: torch.Tensor,
                         groups: tuple[int, ...], cu_seqlens: torch.Tensor, fix: RecomputedRows
                         ) -> tuple[torch.Tensor, ...]:
    """Depthwise causal conv + silu of the packed sequences `cu_seqlens` [N+1] of x `[C, X]`, every sequence from
    zeros, except the rows `fix` recomputes from their history in `[x; extra]` (extra `[R, X]` or None).

    weight `[X, W]`; groups: channel widths X_g (summing to X), each convolved by its own call and returned
    contiguous. Returns one `[C, X_g]` tensor per group."""
    op = RecomputedRowsConv.apply if use_fla(x_CX) else naive_conv_recomputed_rows
    return op(x_CX, extra_RX, weight_XW, tuple(groups), cu_seqlens, fix)
