"""The fused L2 norm kernels (`models.ops.l2norm`) under Triton's interpreter on the CPU: forward and input gradient
against the float64 reference, on head-strided views of a q|k|v tensor, contiguous fp32 inputs, odd head dims and
an empty input. The interpreter runs the kernels' indexing, masks and formulas, not the GPU's code; the CUDA cases
(`test_rowwise_cuda.py`) cover that. TRITON_INTERPRET must be set before triton is imported, hence one subprocess."""

import pytest

from tests.models.ops.interpreted import run_interpreted

pytest.importorskip("triton")

#: (T, H, K), dtype, strided: the middle third of a [T, 3 H K] tensor viewed as [T, H, K].
CASES = [((37, 4, 64), "bfloat16", True), ((5, 3, 100), "float32", False), ((0, 2, 64), "bfloat16", True),
         ((300, 16, 128), "bfloat16", True), ((9, 1, 7), "float32", True)]

SCRIPT = """
import json, sys
import torch
from models.ops.l2norm.fused import fused_l2_norm
from models.ops.l2norm.naive import naive_l2_norm

results = {}
for (T, H, K), dtype, strided in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    if strided:
        x = torch.randn(T, 3 * H * K, generator=g).mul(3).to(dtype)[:, H * K : 2 * H * K].view(T, H, K)
    else:
        x = torch.randn(T, H, K, generator=g).to(dtype)
    dy = torch.randn(T, H, K, generator=g).to(dtype)
    leaf = x.detach().requires_grad_()
    y = fused_l2_norm(leaf)
    (dx,) = torch.autograd.grad(y, leaf, dy)
    ref_leaf = x.detach().double().requires_grad_()
    ref = naive_l2_norm(ref_leaf)
    (ref_dx,) = torch.autograd.grad(ref, ref_leaf, dy.double())
    # One rounding of an fp32 value, to within a bf16 ulp (2^-7 of the row's largest value: the interpreter rounds
    # fp32 to bf16 toward zero, the GPU to nearest) or 2^-20 in fp32 (room for the sum's order) of the float64
    # value, plus 1e-6 near zero; the excess over that bound must be 0.
    bound = 2**-7 if dtype == torch.bfloat16 else 2**-20
    excess = max(((a.double() - b).abs() - bound * b.abs().amax(-1, keepdim=True) - 1e-6).clamp_min(0).max().item()
                 if a.numel() else 0.0 for a, b in zip((y, dx), (ref, ref_dx)))
    results[f"{[T, H, K]} {strided}"] = {
        "excess": excess, "strided": not x.is_contiguous(), "shapes": [list(y.shape), list(dx.shape)],
        "dtypes": [str(y.dtype), str(dx.dtype)],
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("shape,dtype,strided", CASES)
def test_interpreted_kernels_match_the_float64_reference(results, shape, dtype, strided):
    result = results[f"{list(shape)} {strided}"]
    assert result["shapes"] == [list(shape)] * 2 and result["dtypes"] == [f"torch.{dtype}"] * 2
    assert result["strided"] == (strided and shape[0] > 0)
    assert result["excess"] == 0.0, result
