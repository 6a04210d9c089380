"""The split forward/backward varlen attention kernels: the reference against autograd of a masked softmax (float64,
bottom-right causal, GQA, value head dim != q/k head dim); the cuDNN forward's split of views with more keys than
queries on a simulated top-left kernel (CPU, float64) and its refused backward; the backend switch; on CUDA each
backend pair and the autograd Function against the reference (bottom-right, GQA, MLA head dims, empty sequences)."""

import pytest
import torch

from models.ops import dispatch
from models.ops.varlen_attention import (
    cudnn_varlen_backward, cudnn_varlen_forward, flash_varlen_backward, flash_varlen_forward, naive_varlen_backward,
    naive_varlen_forward, varlen_attention, varlen_kernels,
)
from models.ops.varlen_attention import cudnn as cudnn_module
from models.ops.varlen_attention.cudnn import cudnn_unavailable

# Three sequences: more keys than queries (bottom-right), equal, and a single query over many keys.
LENS_Q, LENS_K = [5, 7, 1], [9, 7, 11]
# With empty sequences: no queries over keys, and nothing at all.
LENS_Q_EMPTY, LENS_K_EMPTY = [5, 0, 7, 0], [9, 3, 7, 0]


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _inputs(H, G, K, dtype, device="cpu", seed=0, lens_q=LENS_Q, lens_k=LENS_K, V=None):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda n, h, d=K: torch.randn(n, h, d, dtype=dtype, device=device, generator=g)  # noqa: E731
    V = K if V is None else V
    return mk(sum(lens_q), H), mk(sum(lens_k), G), mk(sum(lens_k), G, V), mk(sum(lens_q), H, V)


def _autograd_reference(q, k, v, dout, scale, lens_q=LENS_Q, lens_k=LENS_K):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    outs, cq, ck = [], _cu(lens_q).tolist(), _cu(lens_k).tolist()
    H = q.shape[1]
    for n in range(len(lens_q)):
        qn = q[cq[n] : cq[n + 1]]
        kn, vn = (x[ck[n] : ck[n + 1]].repeat_interleave(H // k.shape[1], 1) for x in (k, v))
        L, A = qn.shape[0], kn.shape[0]
        mask = torch.arange(A)[None, :] <= (A - L) + torch.arange(L)[:, None]
        s = torch.einsum("qhk,shk->hqs", qn, kn).mul(scale).masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqs,shk->qhk", torch.softmax(s, -1), vn))
    out = torch.cat(outs)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("H,G,V", [(4, 4, 8), (4, 2, 8), (4, 2, 5)])
def test_reference_pair_equals_autograd(H, G, V):
    q, k, v, dout = _inputs(H, G, 8, torch.float64, V=V)
    cq, ck = _cu(LENS_Q), _cu(LENS_K)
    out, lse = naive_varlen_forward(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), 0.35)
    grads = naive_varlen_backward(dout, q, k, v, out, lse, cq, ck, max(LENS_Q), max(LENS_K), 0.35)
    for a, b in zip((out, *grads), _autograd_reference(q, k, v, dout, 0.35)):
        assert (a - b).abs().max() < 1e-12


def _top_left_scores(q, k, cq, ck, causal, scale):
    """Per sequence: scaled scores [H, L, S] masked as cuDNN's ragged kernel does (top-left causal, or none)."""
    H, G = q.shape[1], k.shape[1]
    for n in range(len(cq) - 1):
        qs, ks = slice(cq[n], cq[n + 1]), slice(ck[n], ck[n + 1])
        kn = k[ks].repeat_interleave(H // G, 1)
        s = torch.einsum("qhk,shk->hqs", q[qs], kn) * scale
        if causal:
            L, S = s.shape[1:]
            s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(L)[:, None], float("-inf"))
        yield n, qs, ks, s


def _simulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    cq, ck, H, G = cu_q.tolist(), cu_k.tolist(), q.shape[1], k.shape[1]
    # Rows without keys hold garbage, as a kernel may leave them: the split must mask them itself.
    out = torch.full((q.shape[0], H, v.shape[-1]), float("nan"), dtype=q.dtype)
    lse = torch.full((q.shape[0], H, 1), float("nan"), dtype=q.dtype)
    for n, qs, ks, s in _top_left_scores(q, k, cq, ck, causal, scale):
        if s.shape[2]:
            lse[qs] = s.logsumexp(-1).T[..., None]
            p = torch.exp(s - lse[qs, :, 0].T[:, :, None])
            out[qs] = torch.einsum("hqs,shv->qhv", p, v[ks].repeat_interleave(H // G, 1))
    return out, lse


@pytest.mark.parametrize("lens_q,lens_k", [(LENS_Q, LENS_K), (LENS_Q_EMPTY, LENS_K_EMPTY), ([3, 4], [3, 4])])
def test_cudnn_split_on_top_left_kernel_equals_bottom_right(monkeypatch, lens_q, lens_k):
    """cuDNN's kernels align causal top-left; the forward's split into ancestors (non-causal) and own rows (square,
    causal) merged by log-sum-exp gives bottom-right attention. The backward of such views is refused."""
    monkeypatch.setattr(cudnn_module, "_check", lambda: None)
    monkeypatch.setattr(cudnn_module, "_forward", _simulated_forward)
    q, k, v, dout = _inputs(4, 2, 8, torch.float64, lens_q=lens_q, lens_k=lens_k, V=6)
    args = (_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), 0.35)
    out, lse = cudnn_varlen_forward(q, k, v, *args)
    assert (out - _autograd_reference(q, k, v, dout, 0.35, lens_q, lens_k)[0]).abs().max() < 1e-12
    if sum(lens_k) > sum(lens_q):
        with pytest.raises(NotImplementedError, match="flash"):
            cudnn_varlen_backward(dout, q, k, v, out, lse, *args)


def test_attention_backend_switch(monkeypatch):
    monkeypatch.setattr(dispatch, "_attention_backend", "flash")
    assert dispatch.attention_backend() == "flash"
    dispatch.set_attention_backend("cudnn")
    assert dispatch.attention_backend() == "cudnn"
    with pytest.raises(ValueError, match="flash, cudnn"):
        dispatch.set_attention_backend("flex")
    assert dispatch.attention_backend() == "cudnn"
    # CPU tensors run the reference whatever the backend.
    assert varlen_kernels(torch.zeros(1, dtype=torch.bfloat16)) == (naive_varlen_forward, naive_varlen_backward)


def test_varlen_attention_function_equals_autograd():
    q, k, v, dout = _inputs(4, 2, 8, torch.float64, V=6)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, _cu(LENS_Q), _cu(LENS_K), max(LENS_Q), max(LENS_K), 0.35)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(got, _autograd_reference(q, k, v, dout, 0.35)):
        assert (a - b).abs().max() < 1e-12


def test_varlen_attention_refuses_shapes_no_kernel_takes():
    q, k, v, _ = _inputs(4, 2, 8, torch.float64, V=6)
    args = (_cu(LENS_Q), _cu(LENS_K), max(LENS_Q), max(LENS_K), 0.35)
    with pytest.raises(ValueError, match="divide the query heads 4"):
        varlen_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), *args)
    with pytest.raises(ValueError, match="value head dim 9"):
        varlen_attention(q, k, torch.zeros(*v.shape[:2], 9, dtype=v.dtype), *args)


CUDA_PAIRS = {
    "flash": (flash_varlen_forward, flash_varlen_backward),
    "cudnn": (cudnn_varlen_forward, cudnn_varlen_backward),
}
# (H, G, K, V): MHA, GQA, and MLA's head dims (ling-3-tiny: q/k 192, v 128).
CUDA_SHAPES = [(4, 4, 64, 64), (4, 2, 64, 64), (4, 4, 192, 128), (4, 2, 192, 128)]
CUDA_LENGTHS = [(LENS_Q, LENS_K), (LENS_Q_EMPTY, LENS_K_EMPTY), ([50, 70, 13], [50, 70, 13]),
                ([5, 0, 7], [5, 0, 7]), ([50, 70, 13], [90, 70, 300])]


def _relative_errors(got, ref):
    return {name: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}


def _skip_unavailable(backend):
    if backend == "cudnn" and (reason := cudnn_unavailable()) is not None:
        pytest.skip(reason)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's flash and cuDNN kernels need CUDA")
@pytest.mark.parametrize("backend", list(CUDA_PAIRS))
@pytest.mark.parametrize("H,G,K,V", CUDA_SHAPES)
@pytest.mark.parametrize("lens_q,lens_k", CUDA_LENGTHS)
def test_cuda_pair_equals_reference(backend, H, G, K, V, lens_q, lens_k):
    _skip_unavailable(backend)
    forward, backward = CUDA_PAIRS[backend]
    q, k, v, dout = _inputs(H, G, K, torch.bfloat16, "cuda", lens_q=lens_q, lens_k=lens_k, V=V)
    args = (_cu(lens_q, "cuda"), _cu(lens_k, "cuda"), max(lens_q), max(lens_k), K**-0.5)
    ref = _autograd_reference(*(x.double().cpu() for x in (q, k, v, dout)), K**-0.5, lens_q, lens_k)
    out, lse = forward(q, k, v, *args)
    if backend == "cudnn" and sum(lens_k) > sum(lens_q):
        errors = _relative_errors((out,), ref)
        assert errors["out"] < 1e-2, errors
        with pytest.raises(NotImplementedError, match="flash"):
            backward(dout, q, k, v, out, lse, *args)
        return
    got = (out, *backward(dout, q, k, v, out, lse, *args))
    assert got[0].shape == ref[0].shape and got[3].shape == ref[3].shape
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's flash and cuDNN kernels need CUDA")
@pytest.mark.parametrize("backend", list(CUDA_PAIRS))
def test_cuda_pair_takes_strided_values(backend):
    """Values that are a split view of one projection (MLA's `[k_nope | v]`) give the results of packed values."""
    _skip_unavailable(backend)
    forward, backward = CUDA_PAIRS[backend]
    q, k, v, dout = _inputs(4, 2, 192, torch.bfloat16, "cuda", lens_q=[50, 70, 13], lens_k=[50, 70, 13], V=128)
    kv = torch.cat([torch.randn_like(k), v], dim=-1)
    strided = kv[..., 192:]
    assert not strided.is_contiguous() and torch.equal(strided, v)
    args = (_cu([50, 70, 13], "cuda"), _cu([50, 70, 13], "cuda"), 70, 70, 192**-0.5)
    results = []
    for values in (v, strided):
        out, lse = forward(q, k, values, *args)
        results.append((out, *backward(dout, q, k, values, out, lse, *args)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's flash and cuDNN kernels need CUDA")
@pytest.mark.parametrize("backend", list(CUDA_PAIRS))
def test_cuda_varlen_attention_follows_the_switch(monkeypatch, backend):
    """The autograd Function (flat execution's attention) runs the chosen backend: its results equal the pair's."""
    _skip_unavailable(backend)
    monkeypatch.setattr(dispatch, "_attention_backend", backend)
    forward, backward = CUDA_PAIRS[backend]
    q, k, v, dout = _inputs(4, 2, 192, torch.bfloat16, "cuda", lens_q=LENS_K, lens_k=LENS_K, V=128)
    args = (_cu(LENS_K, "cuda"), _cu(LENS_K, "cuda"), max(LENS_K), max(LENS_K), 192**-0.5)
    out, lse = forward(q, k, v, *args)
    want = (out, *backward(dout, q, k, v, out, lse, *args))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, *args)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
