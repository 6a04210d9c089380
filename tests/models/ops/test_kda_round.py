"""The fla round op of KDA (`models.ops.kda.round`) against its reference, the call-by-call loop of
`LinearAttention.core_round` on fla's `chunk_kda`: outputs, every piece's final state and every gradient, bitwise
(CUDA only). On the host: fla's chunk bookkeeping computed without fla (`fla_chunk_arrays`)."""

import numpy as np
import pytest
import torch

from models.config import KDAConfig
from models.kda import KimiDeltaAttention
from models.linear_attention import CoreInputs
from models.ops.delta_rule.fla_args import fla_chunk_arrays
from models.tree.core_calls import CoreCall
from models.tree.layout import CoreRound, core_rounds
from planner.index_arrays import offsets
from tests.models.ops.delta_rule_cases import make_inputs

B = 64
# Rounds of three sequences, as (start, end) rows of each sequence's pieces:
ROUNDS = {
    # 333 rows cut at chunks 2 and 4, 192 rows cut at chunk 1, 40 rows uncut: later calls drop sequences.
    "dropping": [[(0, 128), (128, 256), (256, 333)], [(0, 64), (64, 192)], [(0, 40)]],
    # every sequence cut once, the second piece one row or several chunks: the calls keep all sequences.
    "continuing": [[(0, 128), (128, 200)], [(0, 64), (64, 65)], [(0, 192), (192, 400)]],
    # nothing cut: one call.
    "single call": [[(0, 100)], [(0, 64)], [(0, 7)]],
}


def round_calls(pieces) -> list[CoreCall]:
    """Call j packs piece j of each sequence; rows numbered sequence after sequence, table indices as in
    `models.tree.core_calls` (call 0 from entries 1..3, later calls from the previous call's finals)."""
    starts = offsets([p[-1][1] for p in pieces])[:-1]
    calls, table = [], 4
    for j in range(max(len(p) for p in pieces)):
        seqs = [s for s, p in enumerate(pieces) if len(p) > j]
        rows = [np.arange(starts[s] + pieces[s][j][0], starts[s] + pieces[s][j][1]) for s in seqs]
        init = np.array([1, 2, 3]) if j == 0 else calls[-1].first_state + np.searchsorted(calls[-1].sequence, seqs)
        gather = np.concatenate(rows)
        calls.append(CoreCall(gather=gather, cu_seqlens=offsets([r.size for r in rows]), init_state=init,
                              output_pos=np.arange(gather.size), round=0, sequence=np.array(seqs), first_state=table))
        table += len(seqs)
    return calls


def test_fla_chunk_arrays_are_fla_bookkeeping():
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    cu = np.array([0, 1, 64, 200, 201, 333, 397])
    indices, first = fla_chunk_arrays(cu, B)
    cu_t = torch.as_tensor(cu)
    assert torch.equal(torch.as_tensor(indices), prepare_chunk_indices(cu_t, B))
    assert torch.equal(torch.as_tensor(first), prepare_chunk_offsets(cu_t, B))


def test_round_layout_links_each_piece_to_its_predecessor():
    rnd = CoreRound.build(round_calls(ROUNDS["dropping"]), B)
    assert rnd.row_bounds == [0, 232, 488, 565] and rnd.final_bounds == [0, 3, 5, 6]
    assert rnd.chunk_bounds == [0, 4, 8, 10] and rnd.chunk_indices.shape[0] == 10  # the round's chunks, call by call
    assert rnd.calls[0].previous is None and rnd.calls[1].previous.tolist() == [0, 1]
    assert rnd.calls[2].previous.tolist() == [0]
    assert rnd.cu_seqlens.tolist() == [0, 128, 192, 232, 360, 488, 565]
    continuing = CoreRound.build(round_calls(ROUNDS["continuing"]), B)
    assert [c.previous for c in continuing.calls] == [None, None]


def test_round_index_tensors_move_to_the_device_in_one_buffer():
    host = core_rounds(round_calls(ROUNDS["dropping"]), B, "cpu")[0]
    moved = core_rounds(round_calls(ROUNDS["dropping"]), B, "meta")[0]
    for a, b in [(host, moved), *zip(host.calls, moved.calls)]:
        for name in ("cu_seqlens", "chunk_indices", "chunk_offsets", "previous"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            assert (x is None) == (y is None), name
            if x is not None:
                assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype == torch.int64, name
    assert all(c.cu_seqlens_cpu.device.type == "cpu" for c in moved.calls)


def test_round_layout_refuses_a_piece_that_does_not_continue_its_sequence():
    calls = round_calls(ROUNDS["dropping"])
    calls[1].init_state = calls[1].init_state[::-1].copy()
    with pytest.raises(AssertionError, match="starts from its sequence's final state"):
        CoreRound.build(calls, B)


class _Backend:
    """A stand-in fla backend (`fla.backends.BaseBackend`'s interface) for the dispatch check."""

    def __init__(self, implements: bool, accepts: bool, enabled: bool = True):
        self.implements, self.accepts, self.enabled, self.priority = implements, accepts, enabled, 0

    def is_available(self):
        return True

    def is_enabled(self):
        return self.enabled

    def get_implementation(self, name):
        return (lambda **kwargs: None) if self.implements else None

    def verify(self, name, **kwargs):
        return self.accepts, None


@pytest.mark.parametrize("backend, default_runs", [
    (None, True),
    (_Backend(implements=False, accepts=True), True),  # e.g. tilelang's 'common' backend: other functions only
    (_Backend(implements=True, accepts=False), True),  # e.g. intra-card CP outside inference mode
    (_Backend(implements=True, accepts=True, enabled=False), True),
    (_Backend(implements=True, accepts=True), False),
])
def test_in_place_recurrences_run_where_fla_dispatch_would_run_its_own_kernels(backend, default_runs, monkeypatch):
    """`models.ops.kda.recurrence` launches fla's kernels itself only where fla's dispatch would run them too (so
    flat's chunk_kda and the tree's rounds run the same implementation), judged as dispatch judges a backend."""
    from fla import backends

    from models.ops.kda import recurrence

    registry = backends._load_operation_registry("common")
    monkeypatch.setattr(registry, "_backends", {} if backend is None else {"fake": backend})
    assert recurrence._default_kernels_run("chunk_gated_delta_rule_fwd_h", {"k": None}) is default_runs


@pytest.mark.parametrize("planned, runs, head_dim, message", [
    (B, 32, 128, "planned for chunk size 64 and the mixer runs 32"),
    (16, 16, 128, "`chunk_size` must be one of"),
    (B, B, 320, "head dim K <= 256"),
])
def test_fla_round_refuses_what_fla_cannot_run(planned, runs, head_dim, message):
    """The round path checks the limits the plain fla path checks (`check_fla_kda_limits`), and that the round
    was planned for the mixer's chunk size, before any kernel."""
    from models.ops.kda.round import fla_kda_round

    rnd = CoreRound.build(round_calls(ROUNDS["single call"]), planned)
    T = sum(rnd.call_rows)
    q = torch.zeros(T, 2, head_dim)
    with pytest.raises(ValueError, match=message):
        fla_kda_round(q, q, torch.zeros(T, 2, 8), q, torch.zeros(T, 2), rnd, None, runs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fla paths need CUDA")
@pytest.mark.parametrize("recomputing", [False, True], ids=["kept layer", "recomputed layer"])
@pytest.mark.parametrize("own_kernels", [True, False], ids=["in place", "dispatched"])
@pytest.mark.parametrize("zero_start", [False, True])
@pytest.mark.parametrize("pieces", list(ROUNDS.values()), ids=list(ROUNDS))
def test_fla_round_matches_call_by_call_bitwise(pieces, zero_start, own_kernels, recomputing, monkeypatch):
    """Also with the recurrences through fla's dispatched wrappers, as where another fla backend is active
    (`models.ops.kda.recurrence`), and in a layer's recomputation, where both paths keep what their backward
    would compute again (`models.recompute.in_recomputed_part`): the same bits as when they recompute it."""
    from models.ops.kda import chunk, recurrence, round as kda_round

    monkeypatch.setattr(recurrence, "_default_kernels_run", lambda name, kwargs: own_kernels)
    config = KDAConfig(num_heads=16, head_dim=128, chunk_size=B)  # ling-3-tiny's heads: kernels cached
    mixer = KimiDeltaAttention(config, hidden_size=256, eps=1e-5).cuda()
    rnd = core_rounds(round_calls(pieces), B, "cuda")[0]
    T = sum(rnd.call_rows)
    x = make_inputs(1, T, 16, 16, 128, 128, True, torch.float32, N=3)
    x["g"] = x["g"] * 0.1  # slow decay: states carry across chunks
    x = {n: (t if n == "initial_state" else t[0]).cuda().to(torch.float32 if n in ("g", "initial_state")
                                                              else torch.bfloat16) for n, t in x.items()}

    def run(fused: bool):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        mixer.round_op = type(mixer).round_op if fused else None
        h0 = None if zero_start else leaves["initial_state"]
        o, finals = mixer.core_round(CoreInputs(*(leaves[n] for n in ("q", "k", "v", "g", "beta"))), rnd, h0)
        gen = torch.Generator(device="cuda").manual_seed(3)
        loss = sum((t.float() * torch.randn(t.shape, generator=gen, device="cuda")).sum() for t in (o, finals))
        names = [n for n in leaves if n != "initial_state" or not zero_start]
        return o, finals, dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))

    o_ref, finals_ref, grads_ref = run(fused=False)
    for module in (chunk, kda_round):
        monkeypatch.setattr(module, "in_recomputed_part", lambda: recomputing)
    o, finals, grads = run(fused=True)
    o_kept, finals_kept, grads_kept = run(fused=False)
    assert finals.shape == (rnd.final_bounds[-1], 16, 128, 128)
    assert torch.equal(o, o_ref) and torch.equal(finals, finals_ref)
    assert torch.equal(o_kept, o_ref) and torch.equal(finals_kept, finals_ref)
    for name, g in grads_ref.items():
        assert torch.equal(grads[name], g), name
        assert torch.equal(grads_kept[name], g), f"{name}, call by call, kept"
