"""Segment sums planned on the host (`models.ops.segment_sum`): the plan of a repeating gather index, the reference
against a loop over positions (float64, exact to rounding), the gradient of a gather it stands for, and on CUDA the
Triton kernel against the reference (fp32 and bf16, strided sources, a row read by thousands of positions)."""

import numpy as np
import pytest
import torch

from models.ops.segment_sum import SegmentPlan, add_segment_sums, naive_add_segment_sums


def plan_of(index, device="cpu") -> SegmentPlan:
    return SegmentPlan(*(torch.as_tensor(a, device=device) for a in SegmentPlan.host_arrays(np.asarray(index))))


def test_plan_groups_positions_by_row_in_position_order():
    rows, order, offsets = SegmentPlan.host_arrays(np.array([4, 1, 4, 0, 4, 1]))
    assert rows.tolist() == [0, 1, 4]
    assert offsets.tolist() == [0, 1, 3, 6]
    assert order.tolist() == [3, 1, 5, 0, 2, 4]
    empty = SegmentPlan.host_arrays(np.zeros(0, np.int64))
    assert [a.tolist() for a in empty] == [[], [], [0]]


def test_reference_adds_the_gradient_of_a_gather():
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, 9, (40,), generator=gen)
    x = torch.randn(12, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(40, 3, 5, generator=gen, dtype=torch.float64)
    (expected,) = torch.autograd.grad(x[index], x, g)
    out = torch.zeros_like(x)
    naive_add_segment_sums(out, g, plan_of(index.numpy()))
    assert (out - expected).abs().max().item() < 1e-14
    # Adding to rows that already hold values, and a second plan on top.
    again = out.clone()
    naive_add_segment_sums(again, g, plan_of(index.numpy()))
    assert (again - 2 * expected).abs().max().item() < 1e-14


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton segment sum needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    # A branch-view-like index: a trunk row in every view, then each view's own rows.
    index = np.concatenate([np.concatenate([np.arange(50), np.arange(100 + 7 * v, 107 + 7 * v)]) for v in range(300)])
    src = torch.randn(index.size, 16, 256, generator=gen).to(dtype).cuda()[..., :192]  # rows 16 x 256 apart
    base = torch.randn(2200, 16, 192, generator=gen).to(dtype).cuda()
    plan = plan_of(index, "cuda")
    out, ref = base.clone(), base.clone()
    add_segment_sums(out, src, plan)
    naive_add_segment_sums(ref, src, plan)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 4e-3), f"relative error {err:.2e}"
    untouched = np.setdiff1d(np.arange(2200), index)
    assert torch.equal(out[untouched], base[untouched])
    again = base.clone()
    add_segment_sums(again, src, plan)
    assert torch.equal(again, out), "the kernel must be deterministic"
