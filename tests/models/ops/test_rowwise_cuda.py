"""Fused row-wise ops (CUDA only) against their plain-torch references: RMSNorm (+ residual), the q/k L2 norm, the
log-probabilities' vocabulary passes and the MoE combine (own Triton kernels), SwiGLU, the sigmoid gate and the KDA
decay gate (fla), forward and every gradient; and row independence: a row's output (and input gradient) is bitwise
the same in a call of 7 rows, of 5,000 rows, and after a shuffle.

Tolerances (relative RMS error against the reference in the same dtype): fp32 1e-5 outputs and gradients (the
reductions' order differs); bf16 1e-2 outputs, 2e-2 gradients (the fused paths round once where the references
round two or three times). The residual sum itself is bitwise equal (one rounding of an exact fp32 sum in both).
"""

import pytest
import torch

from models.ops.combine import naive_moe_combine
from models.ops.combine.fused import fused_moe_combine
from models.ops.gate import fused_kda_decay, naive_kda_decay
from models.ops.glu import fused_sigmoid_gate, fused_swiglu, naive_sigmoid_gate, naive_swiglu
from models.ops.l2norm import naive_l2_norm
from models.ops.l2norm.fused import fused_l2_norm
from models.ops.logsoftmax import naive_exp_sums, naive_logit_grads
from models.ops.logsoftmax.fused import fused_exp_sums, fused_logit_grads
from models.ops.rmsnorm import naive_rms_norm
from models.ops.rmsnorm.fused import fused_rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused row-wise paths need CUDA"),
]

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).pow(2).mean().sqrt() / expected.float().pow(2).mean().sqrt()).item()


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)


def outputs_and_grads(op, inputs, seed=7):
    """op(*inputs) -> tuple of outputs, and the gradients of a random linear loss w.r.t. every input."""
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    out = op(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * randn(*o.shape, dtype=torch.float32, seed=seed + i)).sum() for i, o in enumerate(out))
    return [o.detach() for o in out], torch.autograd.grad(loss, inputs)


def assert_close(name, actual, expected, tolerance):
    err = relative_error(actual, expected)
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert err < tolerance, f"{name}: relative error {err:.2e} >= {tolerance:.0e}"


def norm_op(impl, zero_centered, with_residual):
    if with_residual:
        return lambda x, w, r: impl(x, w, 1e-5, zero_centered, r)
    return lambda x, w: impl(x, w, 1e-5, zero_centered)[0]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", [64, 100, 512, 1536])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["weight", "zero_centered"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_fused_rms_norm_matches_reference(dtype, D, zero_centered, with_residual):
    x = randn(1001, D, dtype=dtype, seed=0, scale=3.0)
    w = randn(D, dtype=dtype, seed=1, scale=0.3) + (0 if zero_centered else 1)
    inputs = [x, w] + ([randn(1001, D, dtype=dtype, seed=2)] if with_residual else [])
    out, grads = outputs_and_grads(norm_op(fused_rms_norm, zero_centered, with_residual), inputs)
    out_ref, grads_ref = outputs_and_grads(norm_op(naive_rms_norm, zero_centered, with_residual), inputs)
    tol_out, tol_grad = TOLERANCES[dtype]
    assert_close("y", out[0], out_ref[0], tol_out)
    if with_residual:
        assert torch.equal(out[1], out_ref[1]), "the residual sum differs"
    for name, a, b in zip(("dx", "dweight", "dresidual"), grads, grads_ref):
        assert_close(name, a, b, tol_grad)


def test_fused_rms_norm_keeps_leading_dims_and_empty_inputs():
    x = randn(5, 3, 64, dtype=torch.bfloat16, seed=0)
    w = randn(64, dtype=torch.bfloat16, seed=1)
    y, s = fused_rms_norm(x, w, 1e-6, True)
    assert y.shape == x.shape and s is x
    assert fused_rms_norm(x[:0], w, 1e-6, True, x[:0])[0].shape == (0, 3, 64)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("K", [64, 100, 128])
def test_fused_l2norm_matches_reference_on_head_strided_views(dtype, K):
    """The k heads of a q|k|v conv output `[T, 3 H K]`, read in place as the linear-attention mixers pass them."""
    T, H = 1001, 4

    def k_heads(op):
        return lambda qkv: op(qkv[:, H * K : 2 * H * K].view(T, H, K))

    qkv = randn(T, 3 * H * K, dtype=dtype, seed=4, scale=3.0)
    out, grads = outputs_and_grads(k_heads(fused_l2_norm), [qkv])
    out_ref, grads_ref = outputs_and_grads(k_heads(naive_l2_norm), [qkv])
    tol_out, tol_grad = TOLERANCES[dtype]
    assert_close("y", out[0], out_ref[0], tol_out)
    assert_close("dqkv", grads[0], grads_ref[0], tol_grad)


GLUS = {"swiglu": (fused_swiglu, naive_swiglu), "sigmoid_gate": (fused_sigmoid_gate, naive_sigmoid_gate)}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("glu", GLUS)
def test_fused_glu_matches_reference_on_strided_halves(dtype, glu):
    """The two halves of a fused gate|up projection `[M, 2F]`, as the routed experts pass them."""
    fast, naive = GLUS[glu]

    def halves(op):
        return lambda both: op(*both.chunk(2, dim=-1))

    both = randn(777, 2 * 96, dtype=dtype, seed=3, scale=2.0)
    out, grads = outputs_and_grads(halves(fast), [both])
    out_ref, grads_ref = outputs_and_grads(halves(naive), [both])
    tol_out, tol_grad = TOLERANCES[dtype]
    assert_close(glu, out[0], out_ref[0], tol_out)
    assert_close(f"d{glu}", grads[0], grads_ref[0], tol_grad)


ROW_OPS = {
    "rms_norm_1536": (lambda x, w, r: fused_rms_norm(x, w, 1e-5, False)[0], 1536),
    "rms_norm_residual_1536": (lambda x, w, r: fused_rms_norm(x, w, 1e-5, True, r)[0], 1536),
    "rms_norm_512": (lambda x, w, r: fused_rms_norm(x, w, 1e-5, False)[0], 512),
    "rms_norm_128": (lambda x, w, r: fused_rms_norm(x, w, 1e-6, True)[0], 128),
    "swiglu_512": (lambda x, w, r: fused_swiglu(x, r), 512),
    "sigmoid_gate_2048": (lambda x, w, r: fused_sigmoid_gate(x, r), 2048),
    "l2_norm_16x128": (lambda x, w, r: fused_l2_norm(x.view(-1, 16, 128)).view(x.shape), 2048),
}


@pytest.mark.parametrize("op", ROW_OPS)
def test_rows_do_not_depend_on_the_other_rows(op):
    """bf16 outputs and input gradients of a row are bitwise equal in calls of 7 and 5,000 rows and after a shuffle
    (tree and flat microbatches hold the same rows in calls of other sizes and orders)."""
    fn, D = ROW_OPS[op]
    T = 5000
    x = randn(T, D, dtype=torch.bfloat16, seed=0, scale=3.0)
    r = randn(T, D, dtype=torch.bfloat16, seed=1)
    w = randn(D, dtype=torch.bfloat16, seed=2, scale=0.3) + 1
    dy = randn(T, D, dtype=torch.bfloat16, seed=3)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0)).cuda()

    def run(rows):
        xs, rs = x[rows].requires_grad_(True), r[rows].requires_grad_(True)
        y = fn(xs, w, rs)
        dx, dr = torch.autograd.grad(y, [xs, rs], dy[rows], allow_unused=True)
        return [t for t in (y, dx, dr) if t is not None]

    full = run(torch.arange(T, device="cuda"))
    for rows in (torch.arange(7, device="cuda"), perm):
        for name, a, b in zip(("y", "dx", "dr"), run(rows), full):
            diff = (a.float() - b[rows].float()).abs().max().item()
            assert torch.equal(a, b[rows]), f"{op} {name} ({len(rows)} rows): max abs diff {diff:.3e}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_moe_combine_matches_reference(dtype):
    T, k, D = 501, 8, 1536
    y = randn(T * k, D, dtype=dtype, seed=0)
    slot = torch.randperm(T * k, generator=torch.Generator().manual_seed(0)).view(T, k).cuda()
    w = torch.rand(T, k, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    out, grads = outputs_and_grads(lambda y_, w_: fused_moe_combine(y_, slot, w_), [y, w])
    out_ref, grads_ref = outputs_and_grads(lambda y_, w_: naive_moe_combine(y_, slot, w_), [y, w])
    tol_out, tol_grad = TOLERANCES[dtype]
    assert_close("out", out[0], out_ref[0], tol_out)
    for name, a, b in zip(("dy", "dweights"), grads, grads_ref):
        assert_close(name, a, b, tol_grad)


def test_moe_combine_rows_do_not_depend_on_the_other_rows():
    """A row's combined output and weight gradients are bitwise equal in calls of 7 and 5,000 rows, and shuffled."""
    T, k, D = 5000, 8, 1536
    y = randn(T * k, D, dtype=torch.bfloat16, seed=0)
    w = torch.rand(T, k, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    dout = randn(T, D, dtype=torch.bfloat16, seed=2)

    def run(rows):
        """The chosen rows' k expert rows, packed densely in slot order, then combined."""
        y_rows = y.view(T, k, D)[rows].reshape(-1, D).requires_grad_(True)
        w_rows = w[rows].requires_grad_(True)
        slot = torch.arange(len(rows) * k, device="cuda").view(-1, k)
        out = fused_moe_combine(y_rows, slot, w_rows)
        dy, dw = torch.autograd.grad(out, [y_rows, w_rows], dout[rows])
        return out, dy.view(-1, k, D), dw

    full = run(torch.arange(T, device="cuda"))
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0)).cuda()
    for rows in (torch.arange(7, device="cuda"), perm):
        for name, a, b in zip(("out", "dy", "dweights"), run(rows), full):
            assert torch.equal(a, b[rows]), f"{name} ({len(rows)} rows) differs"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_kda_decay_matches_reference(dtype):
    T, H, K = 1001, 4, 128
    f = randn(T, H, K, dtype=dtype, seed=0, scale=2.0)
    A_log = (torch.rand(1, 1, H, 1, generator=torch.Generator().manual_seed(0)) * 2).to(dtype).cuda()
    dt_bias = randn(H * K, dtype=dtype, seed=1)
    out, grads = outputs_and_grads(fused_kda_decay, [f, A_log, dt_bias])
    out_ref, grads_ref = outputs_and_grads(naive_kda_decay, [f, A_log, dt_bias])
    tol_out, tol_grad = TOLERANCES[dtype]
    assert_close("g", out[0], out_ref[0], tol_out)
    for name, a, b in zip(("df", "dA_log", "ddt_bias"), grads, grads_ref):
        assert_close(name, a, b, tol_grad)


def test_kda_decay_rows_do_not_depend_on_the_other_rows():
    T, H, K = 5000, 16, 128
    f = randn(T, H, K, dtype=torch.bfloat16, seed=0, scale=2.0)
    A_log = torch.rand(1, 1, H, 1, generator=torch.Generator().manual_seed(0)).bfloat16().cuda()
    dt_bias = randn(H * K, dtype=torch.bfloat16, seed=1)
    dg = randn(T, H, K, dtype=torch.float32, seed=2)

    def run(rows):
        f_rows = f[rows].requires_grad_(True)
        g = fused_kda_decay(f_rows, A_log, dt_bias)
        return g, torch.autograd.grad(g, f_rows, dg[rows])[0]

    full = run(torch.arange(T, device="cuda"))
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0)).cuda()
    for rows in (torch.arange(7, device="cuda"), perm):
        for name, a, b in zip(("g", "df"), run(rows), full):
            assert torch.equal(a, b[rows]), f"{name} ({len(rows)} rows) differs"


def vocabulary_case(R, V, seed=0):
    """fp32 logits `[R, V]`, their max, log-sum-exp and entropy, and predictions: row 0 none, every other row one,
    the last row two more (one target repeated), with their incoming gradients."""
    logits = randn(R, V, dtype=torch.float32, seed=seed, scale=4.0)
    max_R = logits.amax(-1)
    sums = naive_exp_sums(logits, max_R, True)
    lse, ent = max_R + sums[0].log(), sums[0].log() - sums[1] / sums[0]
    gen = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.arange(1, R), torch.tensor([R - 1, R - 1])]).cuda()
    targets = torch.cat([torch.randint(V, (R - 1,), generator=gen), torch.tensor([0, 0])]).cuda()
    values = randn(rows.numel(), dtype=torch.float32, seed=seed + 1)
    g_R = torch.zeros(R, device="cuda").index_add_(0, rows, values)
    return logits, max_R, lse, ent, rows, targets, values, g_R, randn(R, dtype=torch.float32, seed=seed + 2)


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("V", [5000, 157184])
def test_fused_vocabulary_passes_match_reference(entropy, V):
    logits, max_R, lse, ent, rows, targets, values, g_R, ge_R = vocabulary_case(426, V)
    assert_close("sums", fused_exp_sums(logits, max_R, entropy), naive_exp_sums(logits, max_R, entropy), 1e-5)
    args = (logits, lse, g_R, rows, targets, values, ge_R if entropy else None, ent if entropy else None)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        assert_close(f"dlogits {dtype}", fused_logit_grads(*args, dtype), naive_logit_grads(*args, dtype), tolerance)


def test_vocabulary_passes_rows_do_not_depend_on_the_other_rows():
    """A row's sums and bf16 logit gradient are bitwise equal in a chunk of 426 rows and alone with its predictions."""
    logits, max_R, lse, ent, rows, targets, values, g_R, ge_R = vocabulary_case(426, 157184)
    sums = fused_exp_sums(logits, max_R, True)
    d = fused_logit_grads(logits, lse, g_R, rows, targets, values, ge_R, ent, torch.bfloat16)
    for r in (0, 1, 425):
        own = rows == r
        one = slice(r, r + 1)
        assert torch.equal(fused_exp_sums(logits[one], max_R[one], True), sums[:, one]), f"sums of row {r}"
        d_r = fused_logit_grads(logits[one], lse[one], g_R[one], rows[own] - r, targets[own], values[own], ge_R[one],
                                ent[one], torch.bfloat16)
        assert torch.equal(d_r, d[one]), f"gradient of row {r}"
