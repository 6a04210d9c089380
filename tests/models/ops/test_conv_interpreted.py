"""The short conv's Triton kernels (`models.ops.conv.fused`) under Triton's interpreter on the CPU: output and every
gradient (x, weight, bias, initial state) against the float64 reference on packed sequences of any length (shorter
than W-1 too, and longer than a tile), a column slice of a wider tensor, a transposed initial state, channels that
are not a multiple of the tile; and the tree's invariant, bitwise: a sequence split in two, the second part starting
from the first's last rows as its initial state, gives the same output rows. The interpreter runs the kernels'
indexing, masks and formulas, not the GPU's code; `test_rowwise_cuda.py` covers that. TRITON_INTERPRET must be set
before triton is imported, hence one subprocess."""

import pytest

from tests.models.ops.interpreted import run_interpreted

pytest.importorskip("triton")

#: lengths, channels D, width W, bias, initial state, activation
CASES = [
    ([5, 2, 9, 1, 3, 40, 70], 6, 4, True, True, "silu"),
    ([100, 37], 130, 4, False, False, "silu"),
    ([3, 1, 2], 8, 3, False, True, None),
    ([0, 4, 0], 5, 4, True, True, "silu"),
    ([0, 0], 4, 4, False, False, "silu"),
]

SCRIPT = """
import json, sys
import torch
from models.ops.conv.fused import causal_conv1d
from models.ops.conv.naive import naive_causal_conv1d

results = {}
for lengths, D, W, bias, h0, act in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(0)
    T, N = sum(lengths), len(lengths)
    x = torch.randn(1, T, 3 * D, generator=g)[:, :, D : 2 * D]  # a column slice: rows 3 D apart
    w = torch.randn(D, W, generator=g)
    b = torch.randn(D, generator=g) if bias else None
    state = torch.randn(N, W, D, generator=g).transpose(1, 2) if h0 else None  # as the tree builds it
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()])
    dy = torch.randn(1, T, D, generator=g)
    inputs = [t for t in (x, w, b, state) if t is not None]
    errors = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        it = iter(leaves)
        args = [next(it) if t is not None else None for t in (x, w, b, state)]
        run = causal_conv1d if dtype == torch.float32 else naive_causal_conv1d
        y, final = run(args[0], args[1], args[2], args[3], False, act, cu)
        grads = torch.autograd.grad(y, leaves, dy.to(dtype)) if T else [torch.zeros_like(t) for t in leaves]
        errors.append([y] + list(grads))
    # fp32 kernels against float64: relative to each tensor's largest value.
    excess = max(((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() if r.numel() else 0.0
                 for a, r in zip(*errors))
    # The tree's invariant: rows of a sequence split at k, the rest from an initial state of x's rows before k.
    split_equal = True
    if act and lengths and max(lengths) > 6:
        n = max(range(N), key=lambda i: lengths[i])
        start, length = int(cu[n]), lengths[n]
        seq = x[:, start : start + length].contiguous()
        head = None if state is None else state[n : n + 1]
        whole, _ = causal_conv1d(seq, w, b, head, False, act, torch.tensor([0, length]))
        for k in (1, 2, 3, 5):
            hist = torch.cat([torch.zeros(1, 1, D), seq[:, :k] if head is None else
                              torch.cat([head[0, :, 1:].T[None], seq[:, :k]], dim=1)], dim=1)[:, -W:]
            if hist.shape[1] < W:
                hist = torch.cat([torch.zeros(1, W - hist.shape[1], D), hist], dim=1)
            rest, _ = causal_conv1d(seq[:, k:], w, b, hist.transpose(1, 2), False, act, torch.tensor([0, length - k]))
            split_equal &= torch.equal(rest, whole[:, k:])
    results[json.dumps(lengths) + f" {D} {W}"] = {"excess": excess, "split_equal": bool(split_equal),
                                                  "shape": list(y.shape)}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("lengths,D,W,bias,h0,act", CASES)
def test_interpreted_kernels_match_the_float64_reference(results, lengths, D, W, bias, h0, act):
    import json

    result = results[json.dumps(lengths) + f" {D} {W}"]
    assert result["shape"] == [1, sum(lengths), D]
    assert result["excess"] < 1e-5, result
    assert result["split_equal"], "a sequence continued from an initial state must give the same rows bitwise"
