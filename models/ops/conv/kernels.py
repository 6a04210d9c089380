"""Triton kernels of the short causal convolution (CUDA): tiles of packed rows, each row reading its own sequence.

Legend: T packed rows, N sequences, D channels, W kernel width, BT x BD a program's tile of rows x channels,
NB row tiles. Row t of sequence n (rows [bos_n, eos_n), local position p = t - bos_n) sees the extended input
X[p - (W-1) + j], j = 0..W-1, where X[u] is x[bos_n + u] for u >= 0 and the initial state's slot W + u before the
sequence (fla's convention, `models.ops.conv.naive`): z = bias + sum_j w_j X[p - (W-1) + j], y = act(z).

The tiles run over the packed rows, not over each sequence's chunks: a row finds its sequence in `seq` (its index
`[T]`), so a tile may hold the ends of several short sequences (a rollout tree's segments) and no rows are wasted.
Row independence: every row's output and input gradient are sums over its own window in one fixed order (j, then i),
whatever the tile, its neighbours and whether a history row comes from x or from the initial state (the same value
either way). The weight and bias gradients are summed per tile, then over tiles in a fixed order by the caller.
Imported by `models.ops.conv.fused` only (triton import).
"""

import triton
import triton.language as tl

#: Tile shapes (fixed: nothing is autotuned, so no first-use tuning and no shape-dependent rounding).
FWD_BT, FWD_BD, FWD_WARPS = 64, 128, 4
BWD_BT, BWD_BD, BWD_WARPS = 32, 128, 4


@triton.jit
def _history(x, h0, src, ps, n, o_d, m_row, m_d, stride_x, stride_hn, stride_hd, stride_hw, D: tl.constexpr,
             W: tl.constexpr, HAS_H0: tl.constexpr):
    """[BT, BD] fp32 values of X at packed row `src` (local position `ps`) for rows `m_row`: x where ps >= 0, else the
    initial state's slot W + ps (zero without one; strides of sequences, channels and slots given)."""
    inside = ps >= 0
    val = tl.load(x + src[:, None] * stride_x + o_d[None, :], mask=(m_row & inside)[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)
    if HAS_H0:
        slot = W + ps
        m_h = m_row & (~inside) & (slot >= 1)
        p_h = h0 + n[:, None].to(tl.int64) * stride_hn + o_d[None, :] * stride_hd + slot[:, None] * stride_hw
        hist = tl.load(p_h, mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        val = tl.where(inside[:, None], val, hist)
    return val


@triton.jit
def _preactivation(x, w, b, h0, o_t, p, n, o_d, m_row, m_d, stride_x, stride_hn, stride_hd, stride_hw,
                   shift: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr):
    """z `[BT, BD]` fp32 of rows o_t + shift (local positions p + shift), in the fixed order j = 0..W-1, then bias."""
    z = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(W):
        off = shift + j - (W - 1)
        b_x = _history(x, h0, o_t + off, p + off, n, o_d, m_row, m_d, stride_x, stride_hn, stride_hd, stride_hw,
                       D, W, HAS_H0)
        b_w = tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        z += b_x * b_w[None, :]
    if HAS_BIAS:
        z += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def short_conv_fwd_kernel(x, w, b, h0, seq, cu, y, T, stride_x, stride_hn, stride_hd, stride_hw,
                          D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr):
    """y `[T, D]` (contiguous) from x `[T, D]` (row stride `stride_x`), w `[D, W]`, b `[D]`, h0 `[N, D, W]`."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    n = tl.load(seq + o_t, mask=m_t, other=0)
    p = o_t - tl.load(cu + n, mask=m_t, other=0).to(tl.int64)
    z = _preactivation(x, w, b, h0, o_t, p, n, o_d, m_t, m_d, stride_x, stride_hn, stride_hd, stride_hw, 0, D, W,
                       BT, BD, HAS_BIAS, HAS_H0)
    if SILU:
        z = z * tl.sigmoid(z)
    tl.store(y + o_t[:, None] * D + o_d[None, :], z.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def short_conv_bwd_kernel(x, w, b, h0, seq, cu, dy, dx, dw, db, dz_head, T, stride_x, stride_hn, stride_hd,
                          stride_hw, stride_dy, D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                          BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
                          SILU: tl.constexpr):
    """dx `[T, D]` (contiguous), the tile's weight gradient dw `[NB, W, D]` and bias gradient db `[NB, D]` (fp32), and
    with an initial state the pre-activation gradient of each sequence's first W-1 rows, dz_head `[N, W-1, D]` fp32
    (zero-filled by the caller; the initial state's gradient is formed from it).

    dz[t] = dy[t] act'(z[t]); dx[t] = sum_i w_{W-1-i} dz[t+i] over t+i in the sequence (i = 0..W-1, z recomputed
    from x); dw_j = sum_t dz[t] X[p - (W-1) + j]; db = sum_t dz[t]."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    n = tl.load(seq + o_t, mask=m_t, other=0)
    bos = tl.load(cu + n, mask=m_t, other=0).to(tl.int64)
    eos = tl.load(cu + n + 1, mask=m_t, other=0).to(tl.int64)
    p = o_t - bos
    b_dx = tl.zeros((BT, BD), dtype=tl.float32)
    for i in tl.static_range(W):
        m_i = m_t & (o_t + i < eos)
        z = _preactivation(x, w, b, h0, o_t, p, n, o_d, m_i, m_d, stride_x, stride_hn, stride_hd, stride_hw, i, D,
                           W, BT, BD, HAS_BIAS, HAS_H0)
        dz = tl.load(dy + (o_t + i)[:, None] * stride_dy + o_d[None, :], mask=m_i[:, None] & m_d[None, :],
                     other=0.0).to(tl.float32)
        if SILU:
            s = tl.sigmoid(z)
            dz = dz * s * (1 + z * (1 - s))
        b_dx += dz * tl.load(w + o_d * W + (W - 1 - i), mask=m_d, other=0.0).to(tl.float32)[None, :]
        if i == 0:
            # dz of the tile's own rows: the weight and bias gradients, and the heads for the initial state's.
            o_w = tl.arange(0, BW)
            b_dw = tl.zeros((BW, BD), dtype=tl.float32)
            for j in tl.static_range(W):
                b_x = _history(x, h0, o_t + j - (W - 1), p + j - (W - 1), n, o_d, m_t, m_d, stride_x, stride_hn,
                               stride_hd, stride_hw, D, W, HAS_H0)
                b_dw = tl.where(o_w[:, None] == j, b_dw + tl.sum(dz * b_x, axis=0)[None, :], b_dw)
            tl.store(dw + i_t.to(tl.int64) * (W * D) + o_w[:, None] * D + o_d[None, :], b_dw,
                     mask=(o_w < W)[:, None] & m_d[None, :])
            if HAS_BIAS:
                tl.store(db + i_t.to(tl.int64) * D + o_d, tl.sum(dz, axis=0), mask=m_d)
            if HAS_H0:
                m_head = m_t & (p < W - 1)
                tl.store(dz_head + (n.to(tl.int64) * (W - 1) + p)[:, None] * D + o_d[None, :], dz,
                         mask=m_head[:, None] & m_d[None, :])
    tl.store(dx + o_t[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])
