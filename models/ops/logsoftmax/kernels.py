"""Triton kernels of the vocabulary passes of the log-probabilities (CUDA): the log-sum-exp's sums forward and the
logits' gradient backward, each one read of the chunk's fp32 logits.

Legend: R rows, V vocabulary columns, BV columns per block, NSPLIT column ranges per row (forward), P predictions.

Row independence: the forward splits each row into NSPLIT fixed column ranges (by V only) and sums each range in
blocks of BV in a fixed order, so a row's sums are the same bits whatever the other rows of the call; the backward
is elementwise but for the row's own scalars and predictions. Nothing is autotuned.
Imported by `models.ops.logsoftmax.fused` only (triton import).
"""

import triton
import triton.language as tl

#: Columns per block, warps per program, and column ranges per row of the forward sums.
BV = 2048
NUM_WARPS = 8
NSPLIT = 16


@triton.jit(do_not_specialize=["R", "V", "split_cols"])
def exp_sums_fwd_kernel(l, m, s, stride_l, R, V, split_cols, NSPLIT: tl.constexpr, BV: tl.constexpr,
                        ENTROPY: tl.constexpr):
    """s[0, r, i] = sum(exp(x)), s[1, r, i] = sum(exp(x) x) over range i of row r, x = l - m[r]."""
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b_m = tl.load(m + i_r)
    b_s0 = tl.zeros([BV], dtype=tl.float32)
    b_s1 = tl.zeros([BV], dtype=tl.float32)
    start = i_s * split_cols
    end = tl.minimum(start + split_cols, V)
    for c in range(start, end, BV):
        o_v = c + tl.arange(0, BV)
        mask = o_v < end
        b_x = tl.load(l + i_r * stride_l + o_v, mask=mask, other=0.0) - b_m
        b_e = tl.where(mask, tl.exp(b_x), 0.0)
        b_s0 += b_e
        if ENTROPY:
            b_s1 += b_e * b_x
    tl.store(s + i_r * NSPLIT + i_s, tl.sum(b_s0, axis=0))
    if ENTROPY:
        tl.store(s + (R + i_r) * NSPLIT + i_s, tl.sum(b_s1, axis=0))


@triton.jit(do_not_specialize=["V"])
def logit_grads_bwd_kernel(l, lse, g, ptr, tgt, val, ge, ent, d, stride_l, V, BV: tl.constexpr,
                           ENTROPY: tl.constexpr):
    """d = -g p [- ge p (logp + ent)] + the values of row r's predictions at their targets, p = exp(l - lse)."""
    i_r, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_v = i_v * BV + tl.arange(0, BV)
    mask = o_v < V
    b_logp = tl.load(l + i_r * stride_l + o_v, mask=mask, other=0.0) - tl.load(lse + i_r)
    b_p = tl.exp(b_logp)
    b_d = b_p * -tl.load(g + i_r)
    if ENTROPY:
        b_d -= tl.load(ge + i_r) * b_p * (b_logp + tl.load(ent + i_r))
    for j in range(tl.load(ptr + i_r), tl.load(ptr + i_r + 1)):
        b_d += tl.where(o_v == tl.load(tgt + j), tl.load(val + j), 0.0)
    tl.store(d + i_r * V + o_v, b_d.to(d.dtype.element_ty), mask=mask)
