"""RowGather: forward is x[index]; backward (a gather, a fill and a small scatter-add) equals autograd's
scatter-add, for indices with repeated reads and with unread source rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.tree.row_gather import RowGather

CASES = {
    "permutation": lambda rng: rng.permutation(9),
    "repeats": lambda rng: np.concatenate([rng.permutation(9), [2, 2, 7, 0]]),
    "unread": lambda rng: rng.permutation(9)[:5],
    "repeats-and-unread": lambda rng: np.array([4, 1, 4, 4, 8, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_row_gather_matches_indexing(case):
    rng = np.random.default_rng(0)
    index = CASES[case](rng)
    x = torch.randn(9, 3, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(index.size, 3, 2, dtype=torch.float64)
    gather = RowGather.build(index, 9)
    out = gather(x)
    assert torch.equal(out, x.detach()[torch.as_tensor(index)])
    (grad,) = torch.autograd.grad((out * w).sum(), x)
    (expected,) = torch.autograd.grad((x[torch.as_tensor(index)] * w).sum(), x)
    assert torch.allclose(grad, expected, rtol=0, atol=1e-14)
    unread = np.setdiff1d(np.arange(9), index)
    assert (grad[torch.as_tensor(unread)] == 0).all()
