"""KDA and GDN delta-rule cores: the plain-torch references against independent ground truths, packing, per-sequence
and boundary states, gradients, bitwise chunk-partition exactness, and the boundary-state rounds of the fla path
(driven here by the reference kernel on CPU).

Tolerances: float64 vs independent float64 implementation 1e-12; float32 reference vs fla's fp32 naive code 2e-5;
same per-chunk arithmetic: bitwise.
"""

import pytest
import torch

from models.ops.delta_rule.rounds import chunk_delta_rule_in_rounds
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


def loss_weights(o, final, boundary, seed=1):
    """Random linear functional of every output, so each gradient path is exercised."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
        for t in (o, final, boundary)
        if t is not None
    ]


def weighted_loss(outputs, weights):
    return sum((t * w).sum() for t, w in zip([x for x in outputs if x is not None], weights))


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("chunk_size", [16, 5])
def test_naive_matches_sequential_recurrence(op_name, chunk_size):
    op, per_channel = OPS[op_name]
    x = make_inputs(B=2, T=37, H=2, HV=4, K=8, V=6, per_channel_gate=per_channel, dtype=torch.float64)
    o, final, boundary = op(
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
    assert boundary is None
    assert o.dtype == torch.float64 and final.dtype == torch.float64
    assert_close(o, o_ref, F64_TOL, "o")
    assert_close(final, final_ref, F64_TOL, "final_state")


@pytest.mark.parametrize("op_name", OPS)
def test_float32_dtypes_and_zero_initial_state(op_name):
    op, per_channel = OPS[op_name]
    x = make_inputs(B=1, T=20, H=1, HV=2, K=8, V=4, per_channel_gate=per_channel, dtype=torch.float32)
    o, final, _ = op(x["q"], x["k"], x["v"].bfloat16(), x["g"], x["beta"], output_final_state=True, chunk_size=8)
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
    o, final, _ = naive_chunk_kda(*args, initial_state=x["initial_state"], output_final_state=True, chunk_size=16)
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
    o, final, _ = naive_chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
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
    o, final, _ = op(
        *(packed[n] for n in names), initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=16
    )
    weights = loss_weights(o, final, None)
    grads = torch.autograd.grad(
        weighted_loss([o, final], weights), [s[n] for s in seqs for n in (*names, "initial_state")]
    )

    starts = cu_seqlens.tolist()
    separate_loss = 0
    for i, s in enumerate(seqs):
        o_i, final_i, _ = op(
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
def test_gradcheck_with_boundary_states(op_name):
    op, per_channel = OPS[op_name]
    x = make_inputs(1, 12, 1, 2, 3, 2, per_channel, torch.float64, N=2, requires_grad=True)
    cu_seqlens = torch.tensor([0, 7, 12])
    state_seq, state_chunk = torch.tensor([0, 0, 1, 1, 0]), torch.tensor([1, 2, 0, 1, 3])

    def run(q, k, v, g, beta, h0):
        return op(
            q,
            k,
            v,
            g,
            beta,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            chunk_size=3,
            state_seq=state_seq,
            state_chunk=state_chunk,
        )

    inputs = tuple(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-8, fast_mode=True)


def split_and_chain(op, x, lengths, chunk_size, requests):
    """Independent route to boundary states: each sequence on its own, cut at its requested chunk starts, pieces run
    one after another with initial_state = the previous piece's final state. Returns (o, final, boundary)."""
    names = ("q", "k", "v", "g", "beta")
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    outputs, finals, states = [], [], {}
    for i, length in enumerate(lengths):
        num_chunks = -(-length // chunk_size)
        cuts = sorted({c for s, c in requests if s == i and 0 < c < num_chunks})
        edges = [0, *[c * chunk_size for c in cuts], length]
        state = x["initial_state"][i : i + 1]
        states[i, 0] = state[0]
        for c_end, (a, b) in zip([*cuts, num_chunks], zip(edges, edges[1:])):
            piece = [x[n][:, starts[i] + a : starts[i] + b] for n in names]
            o_piece, state, _ = op(*piece, initial_state=state, output_final_state=True, chunk_size=chunk_size)
            outputs.append(o_piece)
            states[i, c_end] = state[0]
        finals.append(state[0])
    return torch.cat(outputs, dim=1), torch.stack(finals), torch.stack([states[r] for r in requests])


@pytest.mark.parametrize("op_name", OPS)
def test_boundary_states_match_split_and_chain(op_name):
    op, per_channel = OPS[op_name]
    lengths, chunk_size = [63, 1, 130, 64], 16
    x = make_inputs(1, sum(lengths), 2, 4, 8, 6, per_channel, torch.float64, N=4, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    # Mid-sequence, initial (chunk 0), final (chunk == number of chunks: 4, 1, 9, 4) and a repeated request.
    requests = [(0, 2), (2, 3), (2, 7), (1, 0), (1, 1), (3, 4), (2, 3), (0, 1), (2, 8)]
    state_seq, state_chunk = (torch.tensor(c) for c in zip(*requests))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    o, final, boundary = op(
        *(x[n] for n in names[:5]),
        initial_state=x["initial_state"],
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        state_seq=state_seq,
        state_chunk=state_chunk,
    )
    o_ref, final_ref, boundary_ref = split_and_chain(op, x, lengths, chunk_size, requests)
    assert boundary.shape == (len(requests), 4, 8, 6) and boundary.dtype == torch.float64
    # Same chunks, same incoming states: every bit agrees in the forward.
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref) and torch.equal(boundary, boundary_ref)
    assert torch.equal(boundary[3], x["initial_state"][1]) and torch.equal(boundary[4], final[1])
    starts = cu_seqlens.tolist()
    for r, (i, c) in enumerate(requests):
        # The state at chunk c is the final state of running only the first c chunks of the sequence.
        prefix = [x[n][:, starts[i] : min(starts[i] + c * chunk_size, starts[i + 1])] for n in names[:5]]
        _, prefix_final, _ = op(
            *prefix, initial_state=x["initial_state"][i : i + 1], output_final_state=True, chunk_size=chunk_size
        )
        assert torch.equal(boundary[r], prefix_final[0]), f"request {r} = (sequence {i}, chunk {c})"

    weights = loss_weights(o, final, boundary)
    grads = torch.autograd.grad(weighted_loss([o, final, boundary], weights), [x[n] for n in names])
    grads_ref = torch.autograd.grad(weighted_loss([o_ref, final_ref, boundary_ref], weights), [x[n] for n in names])
    for name, a, b in zip(names, grads, grads_ref):
        assert_close(a, b, F64_TOL, f"gradient of {name}")


@pytest.mark.parametrize("op_name", OPS)
def test_chunk_partition_is_bitwise_exact(op_name):
    """Tree replay: a sequence that starts at a chunk boundary of a longer one, with that boundary's state, reproduces
    the longer sequence's remaining chunks bit for bit in float32, even packed beside another sequence."""
    op, per_channel = OPS[op_name]
    chunk_size, start = 32, 64
    x = make_inputs(1, 150, 2, 4, 16, 8, per_channel, torch.float32, seed=3)
    names = ("q", "k", "v", "g", "beta")
    o, final, boundary = op(
        *(x[n] for n in names),
        initial_state=x["initial_state"],
        output_final_state=True,
        chunk_size=chunk_size,
        state_seq=torch.tensor([0]),
        state_chunk=torch.tensor([start // chunk_size]),
    )
    other = make_inputs(1, 45, 2, 4, 16, 8, per_channel, torch.float32, seed=4)
    rest = {n: pack([other[n], x[n][:, start:]], [45, 150 - start])[0] for n in names}
    cu_seqlens = torch.tensor([0, 45, 45 + 150 - start])
    h0 = torch.cat([other["initial_state"], boundary])
    o_rest, final_rest, _ = op(
        *(rest[n] for n in names),
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    assert torch.equal(o_rest[0, 45:], o[0, start:]), "outputs of the replayed chunks differ"
    assert torch.equal(final_rest[1], final[0]), "final state differs"

    # Ablation that must differ: starting mid-chunk (at 70, with the exact state there) re-partitions the chunks.
    _, state_70, _ = op(
        *(x[n][:, :70] for n in names), initial_state=x["initial_state"], output_final_state=True, chunk_size=chunk_size
    )
    o_70, _, _ = op(*(x[n][:, 70:] for n in names), initial_state=state_70, chunk_size=chunk_size)
    assert not torch.equal(o_70[0], o[0, 70:]), "re-partitioned chunks should not be bitwise equal: the test lacks bite"
    assert_close(o_70[0], o[0, 70:], 1e-4, "re-partitioned outputs (mathematically equal)")


def reference_kernel(op):
    """A reference op in the fla kernel calling convention, to drive the rounds of the fast path on CPU."""

    def kernel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size):
        assert cu_seqlens_cpu is None or torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        o, final, _ = op(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
        return o, final

    return kernel


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("packed", [True, False], ids=["cu_seqlens", "batch"])
def test_rounds_match_reference(op_name, packed):
    op, per_channel = OPS[op_name]
    chunk_size = 8
    if packed:
        lengths = [30, 5, 41, 16]
        x = make_inputs(1, sum(lengths), 2, 4, 8, 6, per_channel, torch.float64, N=4, requires_grad=True)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        requests = [(0, 1), (2, 5), (2, 2), (0, 3), (1, 0), (3, 2), (2, 6), (2, 2)]
    else:
        x = make_inputs(3, 27, 2, 4, 8, 6, per_channel, torch.float64, requires_grad=True)
        cu_seqlens = None
        requests = [(0, 1), (2, 3), (1, 4), (2, 1)]
    state_seq, state_chunk = (torch.tensor(c) for c in zip(*requests))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    args = (*(x[n] for n in names), True, cu_seqlens, chunk_size, state_seq, state_chunk)
    o, final, boundary = op(args[0], args[1], args[2], args[3], args[4], 0.5, *args[5:])
    o_r, final_r, boundary_r = chunk_delta_rule_in_rounds(reference_kernel(op), *args[:5], 0.5, *args[5:], per_channel)
    assert torch.equal(o, o_r) and torch.equal(final, final_r) and torch.equal(boundary, boundary_r)
    weights = loss_weights(o, final, boundary)
    grads = torch.autograd.grad(weighted_loss([o, final, boundary], weights), [x[n] for n in names])
    grads_r = torch.autograd.grad(weighted_loss([o_r, final_r, boundary_r], weights), [x[n] for n in names])
    for name, a, b in zip(names, grads, grads_r):
        assert_close(a, b, F64_TOL, f"gradient of {name}")


@pytest.mark.parametrize("op_name", OPS)
def test_rounds_without_requests_is_one_call(op_name):
    op, per_channel = OPS[op_name]
    calls = []
    kernel = reference_kernel(op)

    def counting_kernel(*args):
        calls.append(args[8])
        return kernel(*args)

    x = make_inputs(2, 20, 1, 2, 4, 4, per_channel, torch.float64)
    o, final, boundary = chunk_delta_rule_in_rounds(
        counting_kernel,
        *(x[n] for n in ("q", "k", "v", "g", "beta")),
        None,
        None,
        False,
        None,
        8,
        None,
        None,
        per_channel,
    )
    assert len(calls) == 1 and calls[0] is None and final is None and boundary is None
    assert torch.equal(o, op(*(x[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=8)[0])


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
    with pytest.raises(ValueError, match=r"state_chunk\[1\]"):
        op(*args, chunk_size=4, state_seq=torch.tensor([1, 1]), state_chunk=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"state_seq\[0\]"):
        op(*args, chunk_size=4, state_seq=torch.tensor([2]), state_chunk=torch.tensor([0]))
    with pytest.raises(ValueError, match="given together"):
        op(*args, state_seq=torch.tensor([0]))
    fast = {"kda": chunk_kda, "gdn": chunk_gdn}[op_name]
    with pytest.raises(ValueError, match="chunk_size"):
        fast(*args, chunk_size=8)
