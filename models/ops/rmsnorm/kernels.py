"""Triton kernels of the fused RMSNorm (CUDA): forward over blocks of whole rows, backward looping over row blocks.

Legend: T rows, D normalised dim, BD = next power of two >= D, BT rows per block, P backward programs.

Row independence: a block holds BT whole rows in registers and reduces each row along its own axis; BT and the
warp count depend on D only (`block_rows`, `num_warps`), never on T, and nothing is autotuned, so a row's output
is the same bits whatever the other rows of the call are or where the row sits. The weight gradient is the one
reduction across rows (P partial sums, then a torch sum), like the reference's.
Imported by `models.ops.rmsnorm.fused` only (triton import).
"""

import triton
import triton.language as tl


def block_rows(D: int) -> int:
    """Rows per program: about 4,096 elements per block."""
    return max(1, 4096 // triton.next_power_of_2(D))


def num_warps(D: int) -> int:
    return 4 if triton.next_power_of_2(D) <= 1024 else 8


@triton.jit
def rms_norm_fwd_kernel(
    x, res, s, y, w, rstd, T, eps,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    m = m_t[:, None] & m_d[None, :]
    p = o_t[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0)
    if HAS_RESIDUAL:
        # The sum rounds to the input dtype first (the stream the decoder carries), as the reference.
        b_x = (b_x.to(tl.float32) + tl.load(res + p, mask=m, other=0.0).to(tl.float32)).to(b_x.dtype)
        tl.store(s + p, b_x, mask=m)
    b_s = b_x.to(tl.float32)
    b_rstd = tl.math.rsqrt(tl.sum(b_s * b_s, axis=1) / D + eps)
    tl.store(rstd + o_t, b_rstd, mask=m_t)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        b_w = 1.0 + b_w
    b_y = (b_s * b_rstd[:, None]) * b_w[None, :]
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def rms_norm_bwd_kernel(
    s, w, rstd, dy, ds, dx, dw, T, rows_per_program,  # rows_per_program: a multiple of BT
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    HAS_DS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    """dx = (w dy - xhat mean(xhat w dy)) rstd (+ ds), per row; dw partial sums of dy xhat over this program's rows."""
    i_p = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        b_w = 1.0 + b_w
    b_dw = tl.zeros((BT, BD), dtype=tl.float32)
    start = i_p * rows_per_program
    end = tl.minimum(start + rows_per_program, T)
    for i_t in range(start, end, BT):
        o_t = i_t + tl.arange(0, BT)
        m_t = o_t < end
        m = m_t[:, None] & m_d[None, :]
        p = o_t[:, None] * D + o_d[None, :]
        b_s = tl.load(s + p, mask=m, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
        b_rstd = tl.load(rstd + o_t, mask=m_t, other=0.0)
        b_xhat = b_s * b_rstd[:, None]
        b_wdy = b_dy * b_w[None, :]
        b_dw += b_dy * b_xhat
        b_c = tl.sum(b_xhat * b_wdy, axis=1) / D
        b_dx = (b_wdy - b_xhat * b_c[:, None]) * b_rstd[:, None]
        if HAS_DS:
            b_dx += tl.load(ds + p, mask=m, other=0.0).to(tl.float32)
        tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)
    tl.store(dw + i_p * D + o_d, tl.sum(b_dw, axis=0), mask=m_d)
