"""The split forward/backward varlen attention kernels: the reference against autograd of a masked softmax (float64,
bottom-right causal, GQA), and on CUDA the flash pair against the reference."""

import pytest
import torch

from models.ops.varlen_attention import (
    flash_varlen_backward, flash_varlen_forward, naive_varlen_backward, naive_varlen_forward,
)

# Three sequences: more keys than queries (bottom-right), equal, and a single query over many keys.
LENS_Q, LENS_K = [5, 7, 1], [9, 7, 11]


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _inputs(H, G, K, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, K, dtype=dtype, device=device, generator=g)  # noqa: E731
    return mk(sum(LENS_Q), H), mk(sum(LENS_K), G), mk(sum(LENS_K), G), mk(sum(LENS_Q), H)


def _autograd_reference(q, k, v, dout, scale):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    outs, cq, ck = [], _cu(LENS_Q).tolist(), _cu(LENS_K).tolist()
    H = q.shape[1]
    for n in range(len(LENS_Q)):
        qn = q[cq[n] : cq[n + 1]]
        kn, vn = (x[ck[n] : ck[n + 1]].repeat_interleave(H // k.shape[1], 1) for x in (k, v))
        L, A = qn.shape[0], kn.shape[0]
        mask = torch.arange(A)[None, :] <= (A - L) + torch.arange(L)[:, None]
        s = torch.einsum("qhk,shk->hqs", qn, kn).mul(scale).masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqs,shk->qhk", torch.softmax(s, -1), vn))
    out = torch.cat(outs)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2)])
def test_reference_pair_equals_autograd(H, G):
    q, k, v, dout = _inputs(H, G, 8, torch.float64)
    cq, ck = _cu(LENS_Q), _cu(LENS_K)
    out, lse = naive_varlen_forward(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), 0.35)
    grads = naive_varlen_backward(dout, q, k, v, out, lse, cq, ck, max(LENS_Q), max(LENS_K), 0.35)
    for a, b in zip((out, *grads), _autograd_reference(q, k, v, dout, 0.35)):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's flash kernels need CUDA")
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2)])
def test_flash_pair_equals_reference(H, G):
    q, k, v, dout = _inputs(H, G, 64, torch.bfloat16, "cuda")
    cq, ck = _cu(LENS_Q, "cuda"), _cu(LENS_K, "cuda")
    args = (cq, ck, max(LENS_Q), max(LENS_K), 0.125)
    out, lse = flash_varlen_forward(q, k, v, *args)
    got = (out, *flash_varlen_backward(dout, q, k, v, out, lse, *args))
    ref_out, ref_lse = naive_varlen_forward(q, k, v, *args)
    ref = (ref_out, *naive_varlen_backward(dout, q, k, v, ref_out, ref_lse, *args))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
