"""Triton kernel of adding segment sums (CUDA): one program per target row and block of its F columns.

Legend: U target rows, F columns of a row (trailing dims flattened), BF a program's columns.
Determinism: a target's source rows are added in the plan's order in fp32, then its old value, one rounding; no two
programs write the same row. Imported by `models.ops.segment_sum.fused` only (triton import).
"""

import triton
import triton.language as tl

BLOCK_F, NUM_WARPS = 1024, 4


@triton.jit
def add_segment_sums_kernel(out, src, rows, order, offsets, stride_out, stride_src, F: tl.constexpr,
                            BF: tl.constexpr):
    i_u, i_f = tl.program_id(0), tl.program_id(1)
    o_f = i_f * BF + tl.arange(0, BF)
    m_f = o_f < F
    start, end = tl.load(offsets + i_u), tl.load(offsets + i_u + 1)
    acc = tl.zeros((BF,), dtype=tl.float32)
    for k in range(start, end):
        a = tl.load(order + k)
        acc += tl.load(src + a * stride_src + o_f, mask=m_f, other=0.0).to(tl.float32)
    p_out = out + tl.load(rows + i_u) * stride_out + o_f
    acc += tl.load(p_out, mask=m_f, other=0.0).to(tl.float32)
    tl.store(p_out, acc.to(out.dtype.element_ty), mask=m_f)
