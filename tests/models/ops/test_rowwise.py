"""Row-wise op references (RMSNorm + residual, SwiGLU, sigmoid gate, q/k L2 norm, the log-probabilities'
vocabulary passes) on CPU: the dispatchers pick them on CPU and
in float64, and they equal transformers' modules (and the code they replaced) bit for bit.

Tolerances: same operation order: bitwise (fp32 and bf16).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

import models.ops.glu as glu
import models.ops.rmsnorm.fused as rms_norm_fused
from models.ops import dispatch, moe_combine, rms_norm, sigmoid_gate, swiglu
from models.ops.glu import naive_sigmoid_gate, naive_swiglu
from models.ops.rmsnorm import naive_rms_norm
from models.ops.settings import KernelSettings

D = 24
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
IDS = ["fp32", "bf16", "fp64"]


def refuse(*args, **kwargs):
    raise AssertionError("the fast path ran on CPU")


def tensors(dtype, *shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(3 * torch.randn(*shape, generator=gen)).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_dispatch_runs_the_references_on_cpu(dtype, monkeypatch):
    monkeypatch.setattr(rms_norm_fused, "fused_rms_norm", refuse)
    monkeypatch.setattr(glu, "fused_swiglu", refuse)
    monkeypatch.setattr(glu, "fused_sigmoid_gate", refuse)
    x, r, g = tensors(dtype, 7, D)
    w = torch.randn(D, generator=torch.Generator().manual_seed(1)).to(dtype)
    for a, b in zip(rms_norm(x, w, 1e-5, True, r), naive_rms_norm(x, w, 1e-5, True, r)):
        assert torch.equal(a, b)
    assert torch.equal(swiglu(g, x), naive_swiglu(g, x))
    assert torch.equal(sigmoid_gate(g, x), naive_sigmoid_gate(g, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_with_residual_matches_transformers_bitwise(dtype):
    """Qwen3-Next's decoder: residual + hidden in the model dtype, then `Qwen3NextRMSNorm`."""
    module = Qwen3NextRMSNorm(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(0.3 * torch.randn(D, generator=torch.Generator().manual_seed(2)))
    x, r, _ = tensors(dtype, 7, 3, D)
    y, s = naive_rms_norm(x, module.weight, 1e-6, True, residual=r)
    assert torch.equal(s, r + x)
    assert torch.equal(y, module(r + x))
    y_only, s_only = naive_rms_norm(x, module.weight, 1e-6, True)
    assert s_only is x and torch.equal(y_only, module(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_equals_the_replaced_code(dtype):
    """The formula `models.norms.RMSNorm` computed before the dispatcher (weight times the normed x, not zero-centred,
    as Kimi-Linear)."""
    x, _, _ = tensors(dtype, 5, D)
    w = (1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(3))).to(dtype)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    h = x.to(up)
    expected = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.to(up)).to(dtype)
    assert torch.equal(naive_rms_norm(x, w, 1e-5, False)[0], expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_glu_references_equal_the_replaced_code(dtype):
    g, u, _ = tensors(dtype, 5, D)
    assert torch.equal(naive_swiglu(g, u), F.silu(g) * u)
    assert torch.equal(naive_sigmoid_gate(g, u), u * torch.sigmoid(g))


def test_fused_rms_norm_refuses_bad_shapes():
    x = torch.zeros(3, D)
    with pytest.raises(ValueError, match="`weight` must be"):
        rms_norm_fused.check(x, torch.zeros(D + 1), None)
    with pytest.raises(ValueError, match="`residual` must match"):
        rms_norm_fused.check(x, torch.zeros(D), torch.zeros(3, D, dtype=torch.float64))


def test_moe_combine_reference_equals_the_replaced_code(monkeypatch):
    """`models.moe.Experts`' combine before the dispatcher: products in y.dtype, an upcast sum over the k slots."""
    import models.ops.combine.fused as combine_fused
    from models.ops import moe_combine
    from models.ops.combine import naive_moe_combine

    monkeypatch.setattr(combine_fused, "fused_moe_combine", refuse)
    gen = torch.Generator().manual_seed(4)
    T, k = 9, 3
    y = torch.randn(T * k, D, generator=gen).bfloat16()
    slot = torch.randperm(T * k, generator=gen).view(T, k)
    w = torch.rand(T, k, generator=gen)
    expected = (y[slot.reshape(-1)].view(T, k, -1) * w.bfloat16()[:, :, None]).sum(1, dtype=torch.float32).bfloat16()
    assert torch.equal(naive_moe_combine(y, slot, w), expected)
    assert torch.equal(moe_combine(y, slot, w), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_kda_decay_reference_equals_the_replaced_code(dtype, monkeypatch):
    """`models.kda.KimiDeltaAttention.activate`'s gate before the dispatcher."""
    import models.ops.gate as gate
    from models.ops import kda_decay
    from models.ops.gate import naive_kda_decay

    monkeypatch.setattr(gate, "fused_kda_decay", refuse)
    gen = torch.Generator().manual_seed(5)
    T, H, K = 6, 2, 8
    f = torch.randn(T, H * K, generator=gen).to(dtype)
    A_log = torch.rand(1, 1, H, 1, generator=gen).to(dtype)
    dt_bias = torch.randn(H * K, generator=gen).to(dtype)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    expected = -A_log.to(up).exp().view(H, 1) * F.softplus((f.to(up) + dt_bias.to(up)).view(T, H, K))
    assert torch.equal(naive_kda_decay(f.view(T, H, K), A_log, dt_bias), expected)
    assert torch.equal(kda_decay(f.view(T, H, K), A_log, dt_bias), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_l2norm_reference_equals_the_replaced_code(dtype, monkeypatch):
    """The q/k L2 norm the linear-attention mixers computed before the dispatcher (`models.linear_attention.l2norm`),
    on a head-strided view of a q|k|v tensor."""
    import models.ops.l2norm.fused as l2norm_fused
    from models.ops import l2_norm
    from models.ops.l2norm import naive_l2_norm

    monkeypatch.setattr(l2norm_fused, "fused_l2_norm", refuse)
    qkv = tensors(dtype, 5, 3 * 2 * 8)[0]
    k = qkv[:, 16:32].view(5, 2, 8)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (k.to(up) * torch.rsqrt(k.to(up).pow(2).sum(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(naive_l2_norm(k), expected)
    assert torch.equal(l2_norm(k), expected)


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_vocabulary_pass_references_equal_the_replaced_code(dtype, entropy, monkeypatch):
    """`models.logprobs.CompactLogprobsFunction`'s chunk passes before the dispatchers (in-place shifts, a one-hot
    `index_put_` with accumulation, one cast)."""
    import models.ops.logsoftmax.fused as logsoftmax_fused
    from models.ops.logsoftmax import exp_sums, logit_grads

    monkeypatch.setattr(logsoftmax_fused, "fused_exp_sums", refuse)
    monkeypatch.setattr(logsoftmax_fused, "fused_logit_grads", refuse)
    gen = torch.Generator().manual_seed(6)
    logits = (4 * torch.randn(5, 40, generator=gen)).to(dtype)
    max_R = logits.amax(-1)
    shifted = logits.clone().sub_(max_R[:, None])
    e = shifted.exp()
    expected = torch.stack([e.sum(-1), e.mul_(shifted).sum(-1)]) if entropy else shifted.exp().sum(-1)[None]
    sums = exp_sums(logits, max_R, entropy)
    assert torch.equal(sums, expected)
    lse = max_R + sums[0].log()
    ent = sums[0].log() - sums[1] / sums[0] if entropy else None
    rows, targets = torch.tensor([1, 4, 4, 4]), torch.tensor([3, 0, 7, 0])
    values, g_R, ge_R = torch.randn(4, generator=gen), torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    logp = logits.clone().sub_(lse[:, None])
    p = logp.exp()
    d = p * (-g_R[:, None])
    if entropy:
        d -= ge_R[:, None] * p * (logp + ent[:, None])
    d.index_put_((rows, targets), values.to(dtype), accumulate=True)
    got = logit_grads(logits, lse, g_R, rows, targets, values.to(dtype), ge_R if entropy else None, ent,
                      torch.bfloat16)
    assert torch.equal(got, d.bfloat16())


def test_fused_rowwise_is_the_default_and_can_be_turned_off(monkeypatch):
    """The fused paths run by default (`KernelSettings()`, and the dispatchers' default), not where a model's settings
    turn them off, and only on tensors the kernels take."""
    x, w = torch.ones(2, D), torch.ones(D)
    assert KernelSettings().fused_rowwise
    monkeypatch.setattr(dispatch, "use_fla", lambda t: True)
    assert dispatch.use_fused_rowwise(x, KernelSettings().fused_rowwise)
    assert not dispatch.use_fused_rowwise(x, KernelSettings(fused_rowwise=False).fused_rowwise)
    monkeypatch.setattr(rms_norm_fused, "fused_rms_norm", refuse)
    with pytest.raises(AssertionError, match="the fast path ran"):
        rms_norm(x, w, 1e-5, True)
    for a, b in zip(rms_norm(x, w, 1e-5, True, fused=False), naive_rms_norm(x, w, 1e-5, True)):
        assert torch.equal(a, b)
    monkeypatch.setattr(dispatch, "use_fla", lambda t: False)
    assert not dispatch.use_fused_rowwise(x, True)


def test_moe_combine_of_no_rows():
    """An expert-parallel rank whose slice of a microbatch is empty combines 0 rows (tests/parallel/test_tp_ep.py)."""
    y = torch.zeros(0, 8, dtype=torch.bfloat16)
    out = moe_combine(y, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16
