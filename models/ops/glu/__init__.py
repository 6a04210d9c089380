"""Gated linear units: `swiglu` and `sigmoid_gate` run the fused kernels (`fused.py`) on CUDA when `fused` (a
model's `KernelSettings.fused_rowwise`), and the references otherwise."""

from models.ops.dispatch import use_fused_rowwise
from models.ops.glu.fused import fused_sigmoid_gate, fused_swiglu
from models.ops.glu.naive import naive_sigmoid_gate, naive_swiglu


def swiglu(gate, up, *, fused=True):
    """Signature and returns of `models.ops.glu.naive.naive_swiglu`; `fused`: the kernel where it can run."""
    return (fused_swiglu if use_fused_rowwise(gate, fused) else naive_swiglu)(gate, up)


def sigmoid_gate(gate, x, *, fused=True):
    """Signature and returns of `models.ops.glu.naive.naive_sigmoid_gate`; `fused`: the kernel where it can run."""
    return (fused_sigmoid_gate if use_fused_rowwise(gate, fused) else naive_sigmoid_gate)(gate, x)


__all__ = ["fused_sigmoid_gate", "fused_swiglu", "naive_sigmoid_gate", "naive_swiglu", "sigmoid_gate", "swiglu"]
