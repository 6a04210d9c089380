"""Triton kernels of the fused L2 norm (CUDA): forward and backward over blocks of whole rows.

Legend: T rows of the leading dim, H heads, K normalised dim, BK = next power of two >= K, BR (row, head) pairs per
block.

The input is `[T, H, K]` with unit stride along K and any strides along T and H (the q or k heads of a q|k|v conv
output are read in place); outputs and input gradients are contiguous. Row independence: a block holds BR whole
rows in registers and reduces each along its own axis; BR and the warp count depend on K only, never on T or H, and
nothing is autotuned, so a row's result is the same bits whatever the other rows of the call are.
Imported by `models.ops.l2norm.fused` only (triton import).
"""

import triton
import triton.language as tl


def block_rows(K: int) -> int:
    """Rows per program: about 4,096 elements per block."""
    return max(1, 4096 // triton.next_power_of_2(K))


def num_warps(K: int) -> int:
    return 4 if triton.next_power_of_2(K) <= 1024 else 8


@triton.jit
def _rows(i_p, R, H, stride_t, stride_h, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """Block i_p's (row, head) pairs: (input offsets [BR, BK], contiguous offsets [BR, BK], mask [BR, BK])."""
    o_r = i_p * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < R)[:, None] & (o_k < K)[None, :]
    p_x = ((o_r // H) * stride_t + (o_r % H) * stride_h)[:, None] + o_k[None, :]
    p_y = o_r[:, None] * K + o_k[None, :]
    return p_x, p_y, m


@triton.jit(do_not_specialize=["R"])
def l2norm_fwd_kernel(x, y, R, H, stride_t, stride_h, eps, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """y = x rsqrt(sum(x^2) + eps) per row, in fp32, one rounding."""
    p_x, p_y, m = _rows(tl.program_id(0).to(tl.int64), R, H, stride_t, stride_h, K, BK, BR)
    b_x = tl.load(x + p_x, mask=m, other=0.0).to(tl.float32)
    b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + p_y, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["R"])
def l2norm_bwd_kernel(x, dy, dx, R, H, stride_t, stride_h, eps, K: tl.constexpr, BK: tl.constexpr,
                      BR: tl.constexpr):
    """dx = r (dy - y sum(dy y)) per row, r = rsqrt(sum(x^2) + eps) and y = x r recomputed in fp32."""
    p_x, p_y, m = _rows(tl.program_id(0).to(tl.int64), R, H, stride_t, stride_h, K, BK, BR)
    b_x = tl.load(x + p_x, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + p_y, mask=m, other=0.0).to(tl.float32)
    b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) + eps)
    b_y = b_x * b_r[:, None]
    b_dx = (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None]) * b_r[:, None]
    tl.store(dx + p_y, b_dx.to(dx.dtype.element_ty), mask=m)
