"""KDA and GDN delta-rule cores: the plain-torch references against independent ground truths, packing, per-sequence
initial and final states, gradients (gradcheck), and bitwise chunk-partition exactness.

Tolerances: float64 vs independent float64 implementation 1e-12; float32 reference vs fla's fp32 naive code 2e-5;
same per-chunk arithmetic: bitwise.
"""

import pytest
import torch

from models.ops.delta_rule.fla_args import fla_delta_rule_kwargs
from models.ops.gdn import gdn_core
from models.ops.gdn.chunk import chunk_gdn
from models.ops.gdn.naive import naive_chunk_gdn
from models.ops.kda import kda_core
from models.ops.kda.chunk import chunk_kda
from models.ops.kda.naive import naive_chunk_kda
from tests.models.ops.delta_rule_cases import load_fla_naive, make_inputs, pack, sequential_delta_rule

OPS = {"kda": (naive_chunk_kda, True), "gdn": (naive_chunk_gdn, False)}
F64_TOL = 1e-12


def assert_close(actual, expected, tol, what):
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max abs diff {err:.3e}, max |expected| {scale:.3e}, tol {tol:.1e}"


def loss_weights(o, final, seed=1):
    """Random linear functional of every output, so each gradient path is exercised."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in (o, final)]


def weighted_loss(outputs, weights):
    return sum((t * w).sum() for t, w in zip(outputs, weights))


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("chunk_size", [16, 5])
def test_naive_matches_sequential_recurrence(op_name, chunk_size):
    op, per_channel = OPS[op_name]
    x = make_inputs(B=2, T=37, H=2, HV=4, K=8, V=6, per_channel_gate=per_channel, dtype=torch.float64)
    o, final = op(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        scale=0.7,
        initial_state=x["initial_state"],
        output_final_state=True,
        chunk_size=chunk_size,
    )
    o_ref, final_ref = sequential_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.7, x["initial_state"])
    assert o.dtype == torch.float64 and final.dtype == torch.float64
    assert_close(o, o_ref, F64_TOL, "o")
    assert_close(final, final_ref, F64_TOL, "final_state")


@pytest.mark.parametrize("op_name", OPS)
def test_float32_dtypes_and_zero_initial_state(op_name):
    op, per_channel = OPS[op_name]
    x = make_inputs(B=1, T=20, H=1, HV=2, K=8, V=4, per_channel_gate=per_channel, dtype=torch.float32)
    o, final = op(x["q"], x["k"], x["v"].bfloat16(), x["g"], x["beta"], output_final_state=True, chunk_size=8)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    zeros = torch.zeros(1, 2, 8, 4)
    o_ref, final_ref = sequential_delta_rule(
        x["q"], x["k"], x["v"].bfloat16().float(), x["g"], x["beta"], 8**-0.5, zeros
    )
    assert_close(o.float(), o_ref, 1e-2, "o (bf16)")
    assert_close(final, final_ref, 2e-5, "final_state")


def test_kda_matches_fla_naive():
    fla = load_fla_naive("ops/kda/naive.py")
    x = make_inputs(B=2, T=64, H=2, HV=4, K=16, V=8, per_channel_gate=True, dtype=torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, final = naive_chunk_kda(*args, initial_state=x["initial_state"], output_final_state=True, chunk_size=16)
    o_rec, final_rec = fla.naive_recurrent_kda(*args, initial_state=x["initial_state"], output_final_state=True)
    o_chunk, final_chunk = fla.naive_chunk_kda(
        *args, initial_state=x["initial_state"], output_final_state=True, chunk_size=16
    )
    for expected_o, expected_final, name in ((o_rec, final_rec, "recurrent"), (o_chunk, final_chunk, "chunk")):
        assert_close(o, expected_o, 2e-5, f"o vs fla naive_{name}_kda")
        assert_close(final, expected_final, 2e-5, f"final_state vs fla naive_{name}_kda")


def test_gdn_matches_fla_naive():
    fla = load_fla_naive("ops/gated_delta_rule/naive.py")
    # fla's GDN naive code has no GVA: H == HV.
    x = make_inputs(B=2, T=50, H=3, HV=3, K=16, V=8, per_channel_gate=False, dtype=torch.float32)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, final = naive_chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    # Argument-order gotcha: the recurrent version takes beta before g, the chunk version chunk_size before scale.
    o_rec, final_rec = fla.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o_chunk, final_chunk = fla.naive_chunk_gated_delta_rule(
        q, k, v, g, beta, 16, initial_state=h0, output_final_state=True
    )
    for expected_o, expected_final, name in ((o_rec, final_rec, "recurrent"), (o_chunk, final_chunk, "chunk")):
        assert_close(o, expected_o, 2e-5, f"o vs fla naive_{name}_gated_delta_rule")
        assert_close(final, expected_final, 2e-5, f"final_state vs fla naive_{name}_gated_delta_rule")


@pytest.mark.parametrize("op_name", OPS)
def test_packed_equals_separate(op_name):
    op, per_channel = OPS[op_name]
    lengths = [63, 1, 130, 64]
    seqs = [
        make_inputs(1, L, 2, 4, 8, 6, per_channel, torch.float64, seed=i, requires_grad=True)
        for i, L in enumerate(lengths)
    ]
    names = ("q", "k", "v", "g", "beta")
    packed = {n: pack([s[n] for s in seqs], lengths)[0] for n in names}
    cu_seqlens = pack([s["q"] for s in seqs], lengths)[1]
    h0 = torch.cat([s["initial_state"] for s in seqs])
    o, final = op(
        *(packed[n] for n in names), initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=16
    )
    weights = loss_weights(o, final)
    grads = torch.autograd.grad(
        weighted_loss([o, final], weights), [s[n] for s in seqs for n in (*names, "initial_state")]
    )

    starts = cu_seqlens.tolist()
    separate_loss = 0
    for i, s in enumerate(seqs):
        o_i, final_i = op(
            *(s[n] for n in names), initial_state=s["initial_state"], output_final_state=True, chunk_size=16
        )
        # Packing must not change a single bit of the forward: chunks of one sequence see only its rows and state.
        assert torch.equal(o_i[0], o[0, starts[i] : starts[i + 1]]), f"o of sequence {i}"
        assert torch.equal(final_i[0], final[i]), f"final_state of sequence {i}"
        separate_loss = (
            separate_loss
            + (o_i[0] * weights[0][0, starts[i] : starts[i + 1]]).sum()
            + (final_i[0] * weights[1][i]).sum()
        )
    grads_ref = torch.autograd.grad(separate_loss, [s[n] for s in seqs for n in (*names, "initial_state")])
    for n, (a, b) in enumerate(zip(grads, grads_ref)):
        assert_close(a, b, F64_TOL, f"gradient {n} (sequence {n // 6}, input {(*names, 'initial_state')[n % 6]})")


@pytest.mark.parametrize("op_name", OPS)
def test_gradcheck_packed_with_states(op_name):
    op, per_channel = OPS[op_name]
    x = make_inputs(1, 12, 1, 2, 3, 2, per_channel, torch.float64, N=2, requires_grad=True)
    cu_seqlens = torch.tensor([0, 7, 12])

    def run(q, k, v, g, beta, h0):
        return op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=3)

    inputs = tuple(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-8, fast_mode=True)


@pytest.mark.parametrize("op_name", OPS)
def test_chunk_partition_is_bitwise_exact(op_name):
    """Tree replay: a sequence that starts at a chunk boundary of a longer one, with that boundary's state, reproduces
    the longer sequence's remaining chunks bit for bit in float32, even packed beside another sequence."""
    op, per_channel = OPS[op_name]
    chunk_size, start = 32, 64
    x = make_inputs(1, 150, 2, 4, 16, 8, per_channel, torch.float32, seed=3)
    names = ("q", "k", "v", "g", "beta")
    o, final = op(
        *(x[n] for n in names), initial_state=x["initial_state"], output_final_state=True, chunk_size=chunk_size
    )
    # The state at chunk start // chunk_size: the final state of the prefix run.
    _, boundary = op(
        *(x[n][:, :start] for n in names), initial_state=x["initial_state"], output_final_state=True,
        chunk_size=chunk_size,
    )
    other = make_inputs(1, 45, 2, 4, 16, 8, per_channel, torch.float32, seed=4)
    rest = {n: pack([other[n], x[n][:, start:]], [45, 150 - start])[0] for n in names}
    cu_seqlens = torch.tensor([0, 45, 45 + 150 - start])
    h0 = torch.cat([other["initial_state"], boundary])
    o_rest, final_rest = op(
        *(rest[n] for n in names),
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    assert torch.equal(o_rest[0, 45:], o[0, start:]), "outputs of the replayed chunks differ"
    assert torch.equal(final_rest[1], final[0]), "final state differs"

    # Ablation that must differ: starting mid-chunk (at 70, with the exact state there) re-partitions the chunks.
    _, state_70 = op(
        *(x[n][:, :70] for n in names), initial_state=x["initial_state"], output_final_state=True, chunk_size=chunk_size
    )
    o_70, _ = op(*(x[n][:, 70:] for n in names), initial_state=state_70, chunk_size=chunk_size)
    assert not torch.equal(o_70[0], o[0, 70:]), "re-partitioned chunks should not be bitwise equal: the test lacks bite"
    assert_close(o_70[0], o[0, 70:], 1e-4, "re-partitioned outputs (mathematically equal)")


@pytest.mark.parametrize("op_name", OPS)
def test_dispatcher_uses_reference_on_cpu(op_name):
    core = {"kda": kda_core, "gdn": gdn_core}[op_name]
    op, per_channel = OPS[op_name]
    x = make_inputs(1, 10, 1, 2, 4, 4, per_channel, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    assert torch.equal(core(*args, chunk_size=4)[0], op(*args, chunk_size=4)[0])


@pytest.mark.parametrize("op_name", OPS)
def test_invalid_arguments_name_the_argument(op_name):
    op, per_channel = OPS[op_name]
    x = make_inputs(2, 10, 1, 2, 4, 4, per_channel, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="chunk_size"):
        op(*args, chunk_size=0)
    with pytest.raises(ValueError, match="batch size must be 1"):
        op(*args, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        op(*(a[:1] for a in args), cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="initial_state"):
        op(*args, initial_state=x["initial_state"][:1])
    with pytest.raises(ValueError, match="`g`"):
        op(*args[:3], args[3][..., 0] if per_channel else args[3][..., None].expand(2, 10, 2, 4), args[4])
    with pytest.raises(ValueError, match="HV=2"):
        op(args[0].expand(2, 10, 3, 4), args[1].expand(2, 10, 3, 4), *args[2:])
    fast = {"kda": chunk_kda, "gdn": chunk_gdn}[op_name]
    with pytest.raises(ValueError, match="chunk_size"):
        fast(*args, chunk_size=8)
    # The fast paths check shapes without reading offsets (no host sync), before importing fla.
    one = [a[:1] for a in args]
    common = (None, None, False)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        fla_delta_rule_kwargs(*one, *common, torch.tensor([0, 10]), torch.tensor([0, 4, 10]), 64, per_channel)
    with pytest.raises(ValueError, match="batch size must be 1"):
        fla_delta_rule_kwargs(*args, *common, torch.tensor([0, 10]), None, 64, per_channel)
    with pytest.raises(ValueError, match="initial_state"):
        h0 = x["initial_state"][:1]
        fla_delta_rule_kwargs(*one, None, h0, False, torch.tensor([0, 4, 10]), None, 64, per_channel)
    kwargs = fla_delta_rule_kwargs(*one, *common, torch.tensor([0, 10]), torch.tensor([0, 10]), 64, per_channel)
    assert kwargs["state_v_first"] is False and kwargs["use_qk_l2norm_in_kernel"] is False
