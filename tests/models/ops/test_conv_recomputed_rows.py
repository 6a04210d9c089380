"""models.ops.conv.recomputed_rows: a restarted packed conv whose first rows are recomputed from their history equals
the conv run with that history as its initial state (values bitwise, gradients of x, the extra rows and the weight to
1e-12 in float64); the fused CUDA path equals the fla initial-state path bitwise in bf16 and the reference's gradients.
"""

import numpy as np
import pytest
import torch

from models.ops.conv import short_conv
from models.ops.conv.naive import naive_causal_conv1d
from models.ops.conv.recomputed_rows import (
    RecomputedRows,
    RecomputedRowsConv,
    conv_recomputed_rows,
    naive_conv_recomputed_rows,
)
from models.tree.device_copy import to_device

W = 4
LENGTHS = [5, 2, 9, 1, 3, 7]
# Rows of [x; extra] before each sequence, oldest first: full, partial, none, from the extra rows, a sibling's
# repeated rows, one row.
HISTORY = np.array([[-1, -1, -1], [2, 3, 4], [-1, -1, -1], [27, 28, 29], [2, 3, 4], [-1, -1, 12]])


def inputs(groups, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    C, X = sum(LENGTHS), sum(groups)
    x = torch.randn(C, X, generator=gen, dtype=torch.float64)
    extra = torch.randn(3, X, generator=gen, dtype=torch.float64)
    weight = torch.randn(X, W, generator=gen, dtype=torch.float64)
    cu = np.concatenate([[0], np.cumsum(LENGTHS)])
    return ([t.to(device, dtype).requires_grad_() for t in (x, extra, weight)],
            torch.as_tensor(cu, device=device), to_device(RecomputedRows.build(cu, HISTORY), device))


def with_initial_state(x, extra, weight, groups, cu):
    """The conv with each sequence's history as fla's initial state `[N, X, W]` (slot 0 unused, zeros for -1)."""
    source = torch.cat([x, extra])
    history = torch.as_tensor(HISTORY, device=x.device)
    rows = torch.where((history >= 0)[..., None], source[history.clamp(min=0)], 0.0)  # [N, W-1, X]
    state = torch.cat([rows.new_zeros(len(LENGTHS), 1, x.shape[1]), rows], dim=1).transpose(1, 2)
    return tuple(short_conv(x_g[None], w_g, initial_state=s_g, activation="silu", cu_seqlens=cu)[0][0]
                 for x_g, w_g, s_g in zip(x.split(groups, -1), weight.split(groups), state.split(groups, 1)))


def grads(outputs, tensors, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((y.double() * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device)).sum()
               for y in outputs)
    return torch.autograd.grad(loss, tensors)


def test_build_recomputes_the_first_rows_of_sequences_with_history():
    cu = np.concatenate([[0], np.cumsum(LENGTHS)])
    fix = RecomputedRows.build(cu, HISTORY)
    # Sequences 1, 3, 4, 5: history rows then min(length, W-1) first rows.
    assert fix.cu_seqlens.tolist() == [0, 5, 9, 15, 19]
    assert fix.rows.tolist() == [2, 3, 4, 5, 6, 27, 28, 29, 16, 2, 3, 4, 17, 18, 19, 12, 20, 21, 22]
    assert fix.target.tolist() == [5, 6, 16, 17, 18, 19, 20, 21, 22]
    assert fix.rows[fix.keep].tolist() == fix.target.tolist()
    assert fix.extra_pos.tolist() == [5, 6, 7] and fix.extra_rows.tolist() == [0, 1, 2]
    assert fix.rows[fix.own_pos].tolist() == fix.own_rows.tolist() and fix.own_pos.numel() == 16
    assert RecomputedRows.build(cu, np.full((len(LENGTHS), W - 1), -1)) is None


@pytest.mark.parametrize("groups", [(5,), (3, 4, 2)])
def test_equals_the_conv_from_initial_states(groups):
    (x, extra, weight), cu, fix = inputs(groups, torch.float64)
    got = conv_recomputed_rows(x, extra, weight, groups, cu, fix)
    want = with_initial_state(x, extra, weight, groups, cu)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for a, b in zip(grads(got, (x, extra, weight)), grads(want, (x, extra, weight))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_without_extra_rows():
    groups = (5,)
    (x, extra, weight), cu, _ = inputs(groups, torch.float64)
    history = np.where(HISTORY >= sum(LENGTHS), -1, HISTORY)
    fix = RecomputedRows.build(cu.numpy(), history)
    got = conv_recomputed_rows(x, None, weight, groups, cu, fix)[0]
    state_rows = torch.where(torch.as_tensor(history >= 0)[..., None], x[torch.as_tensor(history).clamp(min=0)], 0.0)
    state = torch.cat([state_rows.new_zeros(len(LENGTHS), 1, 5), state_rows], dim=1).transpose(1, 2)
    want = naive_causal_conv1d(x[None], weight, initial_state=state, activation="silu", cu_seqlens=cu)[0][0]
    assert torch.equal(got, want)


def test_fused_function_bookkeeping_with_reference_kernels(monkeypatch):
    """The fused Function's in-place replacement, gradient split and index adds, with fla's two kernels swapped for
    plain-torch ones of the same signature (the kernels themselves run in the CUDA test)."""
    ops = pytest.importorskip("fla.modules.causal_conv1d.ops")

    def fwd(x, weight, bias, residual, initial_state=None, output_final_state=False, activation=None,
            cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False):
        return naive_causal_conv1d(x, weight, bias, initial_state, output_final_state, activation, cu_seqlens)

    def bwd(x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None, cu_seqlens=None,
            cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False):
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        with torch.enable_grad():
            y, _ = naive_causal_conv1d(x, weight, None, None, False, activation, cu_seqlens)
        return (*torch.autograd.grad(y, (x, weight), dy), None, None, None)

    monkeypatch.setattr(ops, "causal_conv1d_fwd", fwd)
    monkeypatch.setattr(ops, "causal_conv1d_bwd", bwd)
    groups = (3, 4, 2)
    (x, extra, weight), cu, fix = inputs(groups, torch.float64)
    got = RecomputedRowsConv.apply(x, extra, weight, groups, cu, fix)
    want = naive_conv_recomputed_rows(x, extra, weight, groups, cu, fix)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for a, b in zip(grads(got, (x, extra, weight)), grads(want, (x, extra, weight))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_path_on_cuda():
    """bf16: the fused path's outputs equal fla's initial-state path bit for bit; its gradients equal the float32
    reference's to bf16 rounding."""
    pytest.importorskip("fla")
    groups = (64, 64, 32)
    (x, extra, weight), cu, fix = inputs(groups, torch.bfloat16, "cuda")
    got = conv_recomputed_rows(x, extra, weight, groups, cu, fix)
    want = with_initial_state(x, extra, weight, groups, cu)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ref_inputs = [t.detach().float().requires_grad_() for t in (x, extra, weight)]
    ref = naive_conv_recomputed_rows(*ref_inputs[:3], groups, cu, fix)
    for a, b in zip(grads(got, (x, extra, weight)), grads(ref, ref_inputs)):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)
