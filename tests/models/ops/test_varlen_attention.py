"""The split forward/backward varlen attention kernels: the reference against autograd of a masked softmax (float64,
bottom-right causal, GQA, value head dim != q/k head dim); which pair a tensor gets; on CUDA each pair (flash, and
fa4 where flash-attn-4 is installed) and the autograd Function against the reference (bottom-right, GQA, MLA head
dims, empty sequences)."""

import builtins

import pytest
import torch

from models.ops.varlen_attention import (
    auto_cuda_attention,
    check_cuda_attention,
    fa4_varlen_forward,
    flash_varlen_forward,
    kernels,
    naive_varlen_backward,
    naive_varlen_forward,
    pads_values,
    varlen_attention,
    varlen_kernels,
)
from models.ops.varlen_attention.fa4 import fa4_interface, native_values

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


def test_cpu_tensors_run_the_reference_pair():
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert varlen_kernels(torch.zeros(1, dtype=dtype)) == (naive_varlen_forward, naive_varlen_backward)


def test_cuda_pair_choice_names_what_is_wrong(no_fa4):
    """An unknown pair is refused with the choices, also as a kernel setting; fa4 without flash-attn-4 says why and
    how to fix it; flash can always run."""
    from models.ops.settings import KernelSettings

    with pytest.raises(ValueError, match="one of flash, fa4, got 'fa3'"):
        check_cuda_attention("fa3")
    with pytest.raises(ValueError, match="one of flash, fa4, got 'fa3'"):
        KernelSettings(attention="fa3")
    with pytest.raises(RuntimeError, match="flash-attn-4 is not importable .*install the flash-attn-4 package"):
        check_cuda_attention("fa4")
    check_cuda_attention("flash")


def test_auto_takes_fa4_only_where_it_can_run_and_says_why_not(no_fa4, monkeypatch):
    """"auto" is flash, with require_fa4's reason, where flash-attn-4 cannot run, and fa4 where it can."""
    pair, why = auto_cuda_attention()
    assert pair == "flash" and "flash-attn-4 is not importable" in why
    monkeypatch.setattr(kernels, "require_fa4", lambda: None)
    assert auto_cuda_attention()[0] == "fa4" and auto_cuda_attention({(192, 128, False)})[0] == "fa4"


def test_auto_keeps_flash_for_head_dims_and_gpus_fa4_was_not_tested_with(fake_fa4, monkeypatch):
    """Of the presets, Qwen3-Next-80B's 256-dim GQA heads were never run with fa4 (flash, naming them); the tiny
    presets' and ling-3-tiny's were. A GPU other than Hopper keeps flash."""
    from models.presets import preset

    for name in ("tiny-qwen3-next", "tiny-kimi-linear", "ling-3-tiny", "kimi-linear-48b-a3b"):
        assert auto_cuda_attention(preset(name).attention_shapes)[0] == "fa4", name
    pair, why = auto_cuda_attention(preset("qwen3-next-80b-a3b").attention_shapes)
    assert pair == "flash" and "head dims 256/256 GQA" in why and "choose fa4" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    pair, why = auto_cuda_attention({(64, 64, False)})
    assert pair == "flash" and "this GPU has 12.0" in why


def test_a_missing_cute_dsl_names_its_wheel(monkeypatch):
    monkeypatch.setattr(builtins, "__import__", _failing_import(ModuleNotFoundError("no cutlass.cute",
                                                                                     name="cutlass.cute")))
    with pytest.raises(RuntimeError, match="install nvidia-cutlass-dsl-libs-core too"):
        fa4_interface()


def _failing_import(error):
    real = builtins.__import__

    def run(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise error
        return real(name, *args, **kwargs)

    return run


def test_cpu_tensors_run_the_reference_whichever_pair_is_chosen(fake_fa4):
    check_cuda_attention("fa4")
    assert varlen_kernels(torch.zeros(1, dtype=torch.bfloat16), "fa4") == (naive_varlen_forward, naive_varlen_backward)
    assert not pads_values(torch.zeros(1, 4, 192, dtype=torch.bfloat16), torch.zeros(1, 2, 128, dtype=torch.bfloat16),
                           "fa4")


def test_fa4_takes_values_at_their_own_dim_only_where_its_hopper_backward_does():
    def native(H, G, K, V):
        return native_values(torch.empty(0, H, K), torch.empty(0, G, V))

    assert native(4, 4, 192, 128) and native(4, 2, 64, 64) and native(4, 4, 96, 96)
    assert not native(4, 2, 192, 128) and not native(4, 4, 64, 32) and not native(4, 4, 96, 64)


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


# (H, G, K, V): MHA, GQA, and MLA's head dims (ling-3-tiny: q/k 192, v 128).
# tiny-kimi-linear's 96/64 and (64, 32) run fa4 with padded values (`fa4.native_values`).
CUDA_SHAPES = [(4, 4, 64, 64), (4, 2, 64, 64), (4, 4, 192, 128), (4, 2, 192, 128), (4, 4, 96, 64), (4, 4, 64, 32)]
CUDA_LENGTHS = [(LENS_Q, LENS_K), (LENS_Q_EMPTY, LENS_K_EMPTY), ([50, 70, 13], [50, 70, 13]),
                ([5, 0, 7], [5, 0, 7]), ([50, 70, 13], [90, 70, 300])]


def _relative_errors(got, ref):
    """Relative L2 error of each CUDA result against the float64 reference on the CPU."""
    return {name: ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}


def _cuda_pair(pair: str):
    return varlen_kernels(torch.zeros(1, dtype=torch.bfloat16, device="cuda"), pair)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel pairs need CUDA")
@pytest.mark.parametrize("H,G,K,V", CUDA_SHAPES)
@pytest.mark.parametrize("lens_q,lens_k", CUDA_LENGTHS)
def test_cuda_pair_equals_reference(H, G, K, V, lens_q, lens_k, cuda_attention_pair):
    q, k, v, dout = _inputs(H, G, K, torch.bfloat16, "cuda", lens_q=lens_q, lens_k=lens_k, V=V)
    args = (_cu(lens_q, "cuda"), _cu(lens_k, "cuda"), max(lens_q), max(lens_k), K**-0.5)
    ref = _autograd_reference(*(x.double().cpu() for x in (q, k, v, dout)), K**-0.5, lens_q, lens_k)
    forward, backward = _cuda_pair(cuda_attention_pair)
    out, lse = forward(q, k, v, *args)
    got = (out, *backward(dout, q, k, v, out, lse, *args))
    assert got[0].shape == ref[0].shape and got[3].shape == ref[3].shape
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel pairs need CUDA")
@pytest.mark.parametrize("G", [4, 2])
def test_cuda_pair_takes_strided_values(G, cuda_attention_pair):
    """Values that are a split view of one projection (MLA's `[k_nope | v]`) give the results of packed values
    (fa4: at their own dim without GQA, padded with it)."""
    forward, backward = _cuda_pair(cuda_attention_pair)
    q, k, v, dout = _inputs(4, G, 192, torch.bfloat16, "cuda", lens_q=[50, 70, 13], lens_k=[50, 70, 13], V=128)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel pairs need CUDA")
def test_cuda_varlen_attention_runs_the_chosen_pair(cuda_attention_pair):
    """The autograd Function (flat execution's attention) runs the chosen pair: its results equal the pair's."""
    forward, backward = _cuda_pair(cuda_attention_pair)
    assert forward is {"flash": flash_varlen_forward, "fa4": fa4_varlen_forward}[cuda_attention_pair]
    q, k, v, dout = _inputs(4, 2, 192, torch.bfloat16, "cuda", lens_q=LENS_K, lens_k=LENS_K, V=128)
    args = (_cu(LENS_K, "cuda"), _cu(LENS_K, "cuda"), max(LENS_K), max(LENS_K), 192**-0.5)
    out, lse = forward(q, k, v, *args)
    want = (out, *backward(dout, q, k, v, out, lse, *args))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, *args, cuda_attention_pair)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel pairs need CUDA")
def test_views_are_padded_once_exactly_where_the_pair_would_pad_them(cuda_attention_pair):
    """`pads_values` (the branch views pad the values once before gathering) agrees with what the pair does inside:
    flash pads every V < K, fa4 all but `native_values`."""
    for H, G, K, V in CUDA_SHAPES:
        q, _, v, _ = _inputs(H, G, K, torch.bfloat16, "cuda", V=V)
        want = V < K and (cuda_attention_pair == "flash" or not native_values(q, v))
        assert pads_values(q, v, cuda_attention_pair) == want, (H, G, K, V)
