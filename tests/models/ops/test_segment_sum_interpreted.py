"""The segment-sum kernel (`models.ops.segment_sum.fused`) under Triton's interpreter on the CPU against the
reference: the same fp32 sums in the same order, so equal bit for bit; strided sources, rows wider than a block,
targets holding values, a plan that touches no row. The interpreter runs the kernel's indexing, masks and order,
not the GPU's code (`test_segment_sum.py` runs it on CUDA). TRITON_INTERPRET must be set before triton is imported,
hence one subprocess."""

import pytest

from tests.models.ops.interpreted import run_interpreted

pytest.importorskip("triton")

#: (positions, target rows, row shape)
CASES = [(40, 9, [3, 5]), (300, 20, [1100]), (0, 4, [7])]

SCRIPT = """
import json, sys
import numpy as np
import torch
from models.ops.segment_sum import SegmentPlan, naive_add_segment_sums
from models.ops.segment_sum.fused import fused_add_segment_sums

results = {}
for A, R, shape in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, R, (A,), generator=g).numpy()
    plan = SegmentPlan(*(torch.as_tensor(a) for a in SegmentPlan.host_arrays(index)))
    wide = torch.randn(A, *shape[:-1], 2 * shape[-1], generator=g)
    src = wide[..., : shape[-1]]
    base = torch.randn(R, *shape, generator=g)
    out, ref = base.clone(), base.clone()
    fused_add_segment_sums(out, src, plan)
    naive_add_segment_sums(ref, src, plan)
    results[f"{A} {R}"] = {"equal": bool(torch.equal(out, ref)), "changed": bool(not torch.equal(out, base))}
print(json.dumps(results))
"""


def test_interpreted_kernel_equals_the_reference():
    results = run_interpreted(SCRIPT, CASES)
    for A, R, _ in CASES:
        assert results[f"{A} {R}"] == {"equal": True, "changed": A > 0}, (A, R)
