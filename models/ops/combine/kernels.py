"""Triton kernels of the fused MoE combine (CUDA): one program per row, its k expert rows gathered in slot order.

Legend: T rows, k experts per row, M = T k, D model dim, BD = next power of two >= D.
Row independence: a program reads its row's k slots only, the block is BD wide with a warp count set by D, nothing
is autotuned, and the sums (over slots forward, over D for the weight gradient) run in one fixed order per row.
Imported by `models.ops.combine.fused` only (triton import).
"""

import triton
import triton.language as tl


def num_warps(D: int) -> int:
    return 4 if triton.next_power_of_2(D) <= 2048 else 8


@triton.jit
def moe_combine_fwd_kernel(y, slot, w, out, D: tl.constexpr, K: tl.constexpr, BD: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(K):
        i_m = tl.load(slot + i_t * K + j).to(tl.int64)
        b_w = tl.load(w + i_t * K + j).to(tl.float32)
        b_acc += tl.load(y + i_m * D + o_d, mask=m_d, other=0.0).to(tl.float32) * b_w
    tl.store(out + i_t * D + o_d, b_acc.to(out.dtype.element_ty), mask=m_d)


@triton.jit
def moe_combine_bwd_kernel(y, slot, w, dout, dy, dw, D: tl.constexpr, K: tl.constexpr, BD: tl.constexpr):
    """dy_{slot_tj} = w_tj dout_t (every y row is one pair's); dw_tj = sum_d dout_td y_{slot_tj, d}."""
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_dout = tl.load(dout + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        i_m = tl.load(slot + i_t * K + j).to(tl.int64)
        b_w = tl.load(w + i_t * K + j).to(tl.float32)
        b_y = tl.load(y + i_m * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        tl.store(dy + i_m * D + o_d, (b_dout * b_w).to(dy.dtype.element_ty), mask=m_d)
        tl.store(dw + i_t * K + j, tl.sum(b_dout * b_y, axis=0))
