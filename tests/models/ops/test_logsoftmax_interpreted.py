"""The fused vocabulary passes of the log-probabilities (`models.ops.logsoftmax`) under Triton's interpreter on the
CPU, against the float64 reference on the same fp32 logits: the log-sum-exp's sums with and without the entropy
sum, over vocabularies that end inside a block and leave column ranges empty; the logits' gradient in fp32 and
bf16, with rows holding no, one and several predictions (a repeated target among them) and the entropy term. The
interpreter runs the kernels' indexing, masks and formulas, not the GPU's code; the CUDA cases
(`test_rowwise_cuda.py`) cover that. TRITON_INTERPRET must be set before triton is imported, hence one subprocess."""

import pytest

from tests.models.ops.interpreted import run_interpreted

pytest.importorskip("triton")

#: (R, V, entropy, gradient dtype)
CASES = [(5, 5000, False, "float32"), (4, 2048, True, "float32"), (3, 40961, True, "bfloat16"),
         (0, 100, True, "float32"), (6, 7, False, "bfloat16")]

SCRIPT = """
import json, sys
import torch
from models.ops.logsoftmax.fused import fused_exp_sums, fused_logit_grads
from models.ops.logsoftmax.naive import naive_exp_sums, naive_logit_grads

results = {}
for R, V, entropy, dtype in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(R + V)
    logits = torch.randn(R, V, generator=g) * 4
    max_R = logits.amax(-1) if R else torch.zeros(0)
    sums = fused_exp_sums(logits, max_R, entropy)
    ref_sums = naive_exp_sums(logits.double(), max_R.double(), entropy)
    lse = (max_R + sums[0].log()) if R else torch.zeros(0)
    ent = (sums[0].log() - sums[1] / sums[0]) if entropy else None
    # Row 0 predicts nothing, row 1 once, the last row three times with a repeated target.
    rows = [1, R - 1, R - 1, R - 1] if R > 2 else []
    targets = [V - 1, 0, V // 2, 0] if R > 2 else []
    rows, targets = torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
    values = torch.randn(rows.numel(), generator=g)
    g_R = torch.zeros(R).index_add_(0, rows, values)
    ge_R = torch.randn(R, generator=g) if entropy else None
    d = fused_logit_grads(logits, lse, g_R, rows, targets, values, ge_R, ent, dtype)
    double = lambda t: None if t is None else t.double()
    ref_d = naive_logit_grads(logits.double(), lse.double(), g_R.double(), rows, targets, values.double(),
                              double(ge_R), double(ent), torch.float64)
    # fp32 sums of fp32 values: within 1e-5 of the float64 value relatively (room for Triton's exp and the sums'
    # order); the bf16 gradient one ulp of its row's largest value (the interpreter rounds toward zero).
    sums_excess = ((sums.double() - ref_sums).abs() - 1e-5 * ref_sums.abs()).clamp_min(0).max().item() if R else 0.0
    bound = 2**-7 if dtype == torch.bfloat16 else 1e-5
    d_bound = bound * ref_d.abs().amax(-1, keepdim=True) + 1e-9
    d_excess = ((d.double() - ref_d).abs() - d_bound).clamp_min(0).max().item() if R else 0.0
    results[f"{R} {V} {entropy} {dtype}"] = {
        "sums_excess": sums_excess, "d_excess": d_excess, "sums_shape": list(sums.shape), "d_shape": list(d.shape),
        "d_dtype": str(d.dtype),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("R,V,entropy,dtype", CASES)
def test_interpreted_kernels_match_the_float64_reference(results, R, V, entropy, dtype):
    result = results[f"{R} {V} {entropy} torch.{dtype}"]
    assert result["sums_shape"] == [2 if entropy else 1, R] and result["d_shape"] == [R, V]
    assert result["d_dtype"] == f"torch.{dtype}"
    assert result["sums_excess"] == 0.0 and result["d_excess"] == 0.0, result
