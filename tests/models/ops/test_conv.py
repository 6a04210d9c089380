"""Short causal convolution reference: per-sequence context, packing, fla's state convention, gradients.

Tolerances: float64 vs F.conv1d 1e-12; same per-row arithmetic (packing, chaining): bitwise.
"""

import pytest
import torch
import torch.nn.functional as F

from models.ops.conv import short_conv
from models.ops.conv.naive import naive_causal_conv1d

D, W = 5, 4


def make_conv_inputs(lengths, dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(
        x=torch.randn(1, sum(lengths), D, generator=gen, dtype=torch.float64),
        weight=torch.randn(D, W, generator=gen, dtype=torch.float64),
        bias=torch.randn(D, generator=gen, dtype=torch.float64),
        initial_state=torch.randn(len(lengths), D, W, generator=gen, dtype=torch.float64),
    )
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return {n: t.to(dtype).requires_grad_(requires_grad) for n, t in tensors.items()}, cu_seqlens


def conv1d_with_history(history_TD, x_TD, weight, bias, activation):
    """Ground truth: F.conv1d over [history; x] without padding, so y[t] sees the W-1 rows before x[t]."""
    full = torch.cat([history_TD, x_TD]).T[None]  # [1, D, W-1+T]
    y = F.conv1d(full, weight[:, None, :], bias, groups=D)[0].T
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", [None, "silu"])
def test_packed_sequences_read_only_their_own_history(activation):
    # Two sequences shorter than W-1: their final states still hold initial-state slots.
    lengths = [5, 2, 9, 1, 3]
    x, cu_seqlens = make_conv_inputs(lengths)
    y, final = naive_causal_conv1d(x["x"], x["weight"], x["bias"], x["initial_state"], True, activation, cu_seqlens)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        history = x["initial_state"][i, :, 1:].T  # [W-1, D], slot W-1 = most recent
        expected = conv1d_with_history(history, x["x"][0, start:end], x["weight"], x["bias"], activation)
        err = (y[0, start:end] - expected).abs().max().item()
        assert err < 1e-12, f"sequence {i}: max abs diff {err:.3e}"
        # fla's convention: the final state is the last W inputs of [initial_state slots; rows].
        assert torch.equal(final[i], torch.cat([x["initial_state"][i].T, x["x"][0, start:end]])[-W:].T), (
            f"final state {i}"
        )


def test_batch_without_state_is_zero_padded_conv():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, D, generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    y, final = naive_causal_conv1d(x, weight, bias, activation="swish")
    # transformers' causal_conv1d_fn torch fallback: F.conv1d with padding W-1, truncated, then silu.
    expected = F.silu(
        F.conv1d(x.transpose(1, 2), weight[:, None, :], bias, padding=W - 1, groups=D)[..., :11]
    ).transpose(1, 2)
    assert final is None
    assert (y - expected).abs().max().item() < 1e-6


def test_packed_equals_separate_and_gradients():
    lengths = [5, 2, 9, 1, 3]
    x, cu_seqlens = make_conv_inputs(lengths, requires_grad=True)
    y, final = naive_causal_conv1d(x["x"], x["weight"], x["bias"], x["initial_state"], True, "silu", cu_seqlens)
    gen = torch.Generator().manual_seed(2)
    wy, wf = torch.randn(y.shape, generator=gen, dtype=y.dtype), torch.randn(final.shape, generator=gen, dtype=y.dtype)
    inputs = [x[n] for n in ("x", "weight", "bias", "initial_state")]
    grads = torch.autograd.grad((y * wy).sum() + (final * wf).sum(), inputs)
    loss = 0
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        y_i, final_i = naive_causal_conv1d(
            x["x"][:, start:end], x["weight"], x["bias"], x["initial_state"][i : i + 1], True, "silu"
        )
        # Not bitwise: torch's vectorised silu differs from its scalar tail loop in the last ulp.
        assert (y_i[0] - y[0, start:end]).abs().max().item() < 1e-15, f"sequence {i}"
        assert torch.equal(final_i[0], final[i]), f"final state of sequence {i}"
        loss = loss + (y_i[0] * wy[0, start:end]).sum() + (final_i[0] * wf[i]).sum()
    for name, a, b in zip(("x", "weight", "bias", "initial_state"), grads, torch.autograd.grad(loss, inputs)):
        err = (a - b).abs().max().item()
        assert err < 1e-12, f"gradient of {name}: max abs diff {err:.3e}"


def test_chaining_final_state_equals_one_pass():
    """A sequence continued from its parent's final state reproduces the one-pass pre-activation outputs bit for bit."""
    x, _ = make_conv_inputs([10], dtype=torch.float32)
    y, _ = naive_causal_conv1d(x["x"], x["weight"], x["bias"], x["initial_state"])
    for split in (1, 2, 3, 7):
        _, state = naive_causal_conv1d(x["x"][:, :split], x["weight"], x["bias"], x["initial_state"], True)
        y_rest, _ = naive_causal_conv1d(x["x"][:, split:], x["weight"], x["bias"], state)
        assert torch.equal(y_rest, y[:, split:]), f"continuation after {split} rows"


def test_gradcheck_including_initial_state():
    lengths = [2, 1, 6]
    x, cu_seqlens = make_conv_inputs(lengths, requires_grad=True)

    def run(x_, weight, bias, h0):
        y, final = naive_causal_conv1d(x_, weight, bias, h0, True, "silu", cu_seqlens)
        return y, final[..., 1:]

    assert torch.autograd.gradcheck(run, tuple(x[n] for n in ("x", "weight", "bias", "initial_state")))


def test_final_state_slot_zero_carries_no_gradient():
    """As in fla: slot 0 of the state is padding, so its gradient is dropped (the forward never reads it)."""
    x, cu_seqlens = make_conv_inputs([6, 2], requires_grad=True)
    _, final = naive_causal_conv1d(x["x"], x["weight"], None, x["initial_state"], True, None, cu_seqlens)
    dx, dh0 = torch.autograd.grad(
        final[..., 0].sum(), [x["x"], x["initial_state"]], allow_unused=True, materialize_grads=True, retain_graph=True
    )
    assert not dx.any() and not dh0.any()
    dx, dh0 = torch.autograd.grad(final[..., 1].sum(), [x["x"], x["initial_state"]])
    # Slot 1 of the 6-row sequence is x[6-3]; of the 2-row sequence it is initial_state slot 3.
    assert dx[0, 3].eq(1).all() and dh0[1, :, 3].eq(1).all() and dx.sum() == D and dh0.sum() == D


def test_dispatcher_and_validation():
    x, cu_seqlens = make_conv_inputs([4, 3], dtype=torch.float32)
    args = (x["x"], x["weight"], x["bias"], x["initial_state"], True, "silu", cu_seqlens)
    assert all(torch.equal(a, b) for a, b in zip(short_conv(*args), naive_causal_conv1d(*args)))
    with pytest.raises(ValueError, match="activation"):
        naive_causal_conv1d(x["x"], x["weight"], activation="relu")
    with pytest.raises(ValueError, match="weight"):
        naive_causal_conv1d(x["x"], x["weight"].T)
    with pytest.raises(ValueError, match="initial_state"):
        naive_causal_conv1d(x["x"], x["weight"], initial_state=x["initial_state"][:1], cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match="batch size must be 1"):
        naive_causal_conv1d(x["x"].expand(2, 7, D), x["weight"], cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens"):
        naive_causal_conv1d(x["x"], x["weight"], cu_seqlens=torch.tensor([0, 3]))
