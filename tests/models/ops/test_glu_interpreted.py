"""The fused GLU kernels (`models.ops.glu`) under Triton's interpreter on the CPU: forward and both gradients of SwiGLU
and the sigmoid gate against the float64 reference, on row-strided halves of a gate|up product, a 3-D input and an
empty one. The interpreter runs the kernels' indexing, masks and formulas, not the GPU's code; the CUDA cases
(`test_rowwise_cuda.py`) cover that. TRITON_INTERPRET must be set before triton is imported, hence one subprocess."""

import pytest

from tests.models.ops.interpreted import run_interpreted

pytest.importorskip("triton")

CASES = [((37, 24), True), ((3, 5, 40), False), ((0, 16), True), ((3, 0), False), ((700, 9), True)]
GLUS = ("swiglu", "sigmoid_gate")

SCRIPT = """
import json, sys
import torch
from models.ops.glu.fused import fused_sigmoid_gate, fused_swiglu
from models.ops.glu.naive import naive_sigmoid_gate, naive_swiglu

GLUS = {"swiglu": (fused_swiglu, naive_swiglu), "sigmoid_gate": (fused_sigmoid_gate, naive_sigmoid_gate)}
results = {}
for glu, (fast, naive) in GLUS.items():
    for shape, split in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(0)
        if split:  # the two halves of one [..., 2F] product: row-strided views
            gate, other = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).mul(3).bfloat16().chunk(2, dim=-1)
        else:
            gate, other = (torch.randn(*shape, generator=g).mul(3).bfloat16() for _ in range(2))
        dz = torch.randn(*shape, generator=g).bfloat16()
        leaves = [t.detach().requires_grad_() for t in (gate, other)]
        out = fast(*leaves)
        grads = torch.autograd.grad(out, leaves, dz)
        ref_leaves = [t.detach().double().requires_grad_() for t in (gate, other)]
        ref = naive(*ref_leaves)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dz.double())
        # Each result is one bf16 rounding of an fp32 value: within 2^-8 of the float64 value, relatively; the
        # excess over 2^-7 (room for the interpreter's fp32 sigmoid) and 1e-6 (near zero) must be 0.
        excess = max(((a.double() - b).abs() - 2**-7 * b.abs() - 1e-6).clamp_min(0).max().item() if a.numel() else 0.0
                     for a, b in zip((out, *grads), (ref, *ref_grads)))
        results[f"{glu} {shape} {split}"] = {
            "excess": excess, "strided": not gate.is_contiguous(), "shape": list(out.shape),
            "dtypes": [str(t.dtype) for t in (out, *grads)],
        }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("shape,split", CASES)
def test_interpreted_kernels_match_the_float64_reference(results, glu, shape, split):
    result = results[f"{glu} {list(shape)} {split}"]
    assert result["shape"] == list(shape) and result["dtypes"] == ["torch.bfloat16"] * 3
    assert result["strided"] == (split and shape[0] > 0)
    assert result["excess"] == 0.0, result
