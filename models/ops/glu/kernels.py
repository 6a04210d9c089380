"""Triton kernels of the fused gated linear units (CUDA): act(gate) * x forward, and both input gradients in one
backward pass that recomputes the activation. ACT: "swish" (SwiGLU: silu(gate) * up) or "sigmoid" (the output gate).

Legend: R rows (leading dims flattened), D width, B elements per program.

Elementwise over the flattened `[R, D]` rows (each may be a row-strided view, like the halves of a gate|up product):
an element's result never depends on another element, on B or on the warp count. B and the warp count are fixed
and nothing is autotuned: fla's `swiglu` / `sigmoidglu` kernels, which these replace, compile and time 30 configs
per width on first use, a large share of a cold first step's compilations (docs/history.md, "the first step with a
cold and a warm kernel cache"; how this config compares with fla's tuned ones: "own GLU kernels"). The formulas
and their fp32 order are fla's (fla/modules/activations/ops.py, fla 0.6.0).
Imported by `models.ops.glu.fused` only (triton import).
"""

import triton
import triton.language as tl

#: Elements per program and warps per program: 4 elements per thread.
BLOCK = 1024
NUM_WARPS = 8


@triton.jit
def _activation(b_x, ACT: tl.constexpr):
    b_s = tl.sigmoid(b_x)
    if ACT == "swish":
        b_a = b_x * b_s
    else:
        b_a = b_s
    return b_a, b_s


@triton.jit(do_not_specialize=["N"])
def glu_fwd_kernel(g, x, z, stride_g, stride_x, N, D: tl.constexpr, B: tl.constexpr, ACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mask = offs < N
    row, col = offs // D, offs % D
    b_g = tl.load(g + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    b_x = tl.load(x + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    b_a, _ = _activation(b_g, ACT)
    tl.store(z + offs, (b_a * b_x).to(z.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def glu_bwd_kernel(g, x, dz, dg, dx, stride_g, stride_x, N, D: tl.constexpr, B: tl.constexpr, ACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mask = offs < N
    row, col = offs // D, offs % D
    b_g = tl.load(g + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    b_x = tl.load(x + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    b_dz = tl.load(dz + offs, mask=mask, other=0.0).to(tl.float32)
    b_a, b_s = _activation(b_g, ACT)
    if ACT == "swish":
        b_dg = b_dz * b_s * (1.0 + b_g * (1.0 - b_s)) * b_x
    else:
        b_dg = b_dz * b_s * (1.0 - b_s) * b_x
    tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=mask)
    tl.store(dx + offs, (b_dz * b_a).to(dx.dtype.element_ty), mask=mask)
