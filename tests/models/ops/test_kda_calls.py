"""The fla op of a tree layer's KDA calls (`models.ops.kda.tree_calls`) against its reference, the call-by-call loop of
`LinearAttention.core_calls` on fla's `chunk_kda`: outputs, the state table and every gradient, bitwise (CUDA only;
where two pieces share a start, the gradients to rounding).
On the host: the calls' layout and fla's chunk bookkeeping computed without fla (`fla_chunk_arrays`)."""

import numpy as np
import pytest
import torch

from models.config import KDAConfig
from models.kda import KimiDeltaAttention
from models.linear_attention import CoreInputs
from models.ops.delta_rule.fla_args import fla_chunk_arrays
from models.tree.device_copy import to_device
from models.tree.layout import CoreCalls
from tests.models.ops.delta_rule_cases import make_inputs
from tests.models.ops.kda_calls_cases import ROUNDS, B, layer_calls


def test_fla_chunk_arrays_are_fla_bookkeeping():
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    cu = np.array([0, 1, 64, 200, 201, 333, 397])
    indices, first = fla_chunk_arrays(cu, B)
    cu_t = torch.as_tensor(cu)
    assert torch.equal(torch.as_tensor(indices), prepare_chunk_indices(cu_t, B))
    assert torch.equal(torch.as_tensor(first), prepare_chunk_offsets(cu_t, B))


def test_calls_layout_names_each_piece_s_table_entry():
    calls = CoreCalls.build(layer_calls(ROUNDS["dropping"]), B, table_start=4)
    assert calls.row_bounds == [0, 232, 488, 565, 640] and calls.table_size == 4 + 3 + 2 + 1 + 2
    assert calls.chunk_bounds == [0, 4, 8, 10, 13] and calls.chunk_indices.shape[0] == 13  # chunks call by call
    assert calls.cu_seqlens.tolist() == [0, 128, 192, 232, 360, 488, 565, 635, 640]
    assert [c.init_state for c in calls.calls] == [(1, 2, 3), (4, 5), (7,), (4, 4)]
    assert [c.first_state for c in calls.calls] == [4, 7, 9, 10] and calls.rounds == 2 and calls.outside_states == 3
    assert [c.init_entries for c in calls.calls[:3]] == [slice(1, 4), slice(4, 6), slice(7, 8)]  # runs: views
    assert calls.calls[3].init_entries.tolist() == [4, 4]  # a shared start: a gather
    for call, pieces in zip(calls.calls, ([0, 128, 192, 232], [0, 128, 256], [0, 77], [0, 70, 75])):
        assert call.cu_seqlens.tolist() == call.cu_seqlens_cpu.tolist() == pieces
        indices, first = fla_chunk_arrays(np.array(pieces), B)
        assert call.chunk_indices.tolist() == indices.tolist() and call.chunk_offsets.tolist() == first.tolist()
    zeros = CoreCalls.build(layer_calls(ROUNDS["single call"], outside=False), B, table_start=1)
    assert zeros.calls[0].init_state is None and zeros.calls[0].init_entries is None and zeros.outside_states == 0


def test_call_index_tensors_move_to_the_device_in_one_buffer():
    host = CoreCalls.build(layer_calls(ROUNDS["dropping"]), B, 4)
    moved = to_device(host, "meta")
    for a, b in [(host, moved), *zip(host.calls, moved.calls)]:
        for name in ("cu_seqlens", "chunk_indices", "chunk_offsets", "init_entries"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            assert (x is None) == (y is None), name
            if isinstance(x, slice):  # a run of entries: read as a view, nothing to move
                assert y == x, name
            elif x is not None:
                assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype == torch.int64, name
    assert all(c.cu_seqlens_cpu.device.type == "cpu" for c in moved.calls)


def test_calls_layout_refuses_a_piece_that_starts_from_a_later_state():
    calls = layer_calls(ROUNDS["dropping"])
    calls[1].init_state = calls[1].init_state + 2  # entries 6, 7: 7 is the second call's own first final state
    with pytest.raises(AssertionError, match="earlier calls' final states"):
        CoreCalls.build(calls, B, table_start=4)


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
def test_chain_recurrences_run_where_fla_dispatch_would_run_its_own_kernels(backend, default_runs, monkeypatch):
    """The tree's calls run the recurrences on the chain variant of fla's kernels (`models.ops.kda.chains`) only
    where fla's dispatch would run fla's kernels too (so flat's chunk_kda and the tree's rounds run the same
    arithmetic), judged as dispatch judges a backend (`models.ops.kda.recurrence`)."""
    from fla import backends

    from models.ops.kda import recurrence

    registry = backends._load_operation_registry("common")
    monkeypatch.setattr(registry, "_backends", {} if backend is None else {"fake": backend})
    assert recurrence.default_kernels_run("chunk_gated_delta_rule_fwd_h", {"k": None}) is default_runs


@pytest.mark.parametrize("chunk, head_dim, message", [
    (16, 128, "`chunk_size` must be one of"),
    (B, 320, "head dim K <= 256"),
])
def test_fla_calls_refuse_what_fla_cannot_run(chunk, head_dim, message):
    """The calls' path checks the limits the plain fla path checks (`check_fla_kda_limits`) before any kernel; it
    takes the calls' arrays as the tree layer hands them over (`LinearAttention.core_calls`)."""
    from models.ops.kda.tree_calls import fla_kda_calls

    calls = CoreCalls.build(layer_calls(ROUNDS["single call"]), chunk, table_start=4)
    T = sum(calls.call_rows)
    q = torch.zeros(T, 2, head_dim)
    with pytest.raises(ValueError, match=message):
        fla_kda_calls(q, q, torch.zeros(T, 2, 8), q, torch.zeros(T, 2), torch.zeros(3, 2, head_dim, 8),
                      calls.cu_seqlens, calls.chunk_indices, calls.chunk_offsets, calls.calls, calls.chains, chunk)


def test_calls_refuse_a_plan_for_another_chunk_size():
    """The calls must be planned for the mixer's chunk size, checked before any kernel."""
    calls = CoreCalls.build(layer_calls(ROUNDS["single call"]), B, table_start=4)
    mixer = KimiDeltaAttention(KDAConfig(num_heads=2, head_dim=8, chunk_size=32), hidden_size=16, eps=1e-5)
    T = sum(calls.call_rows)
    inputs = CoreInputs(*(torch.zeros(T, 2, *shape) for shape in ((8,), (8,), (8,), (8,), ())))
    with pytest.raises(ValueError, match="planned for chunk size 64 and the mixer runs 32"):
        mixer.core_calls(inputs, calls, torch.zeros(3, 2, 8, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fla paths need CUDA")
@pytest.mark.parametrize("recomputing", [False, True], ids=["kept layer", "recomputed layer"])
@pytest.mark.parametrize("own_kernels", [True, False], ids=["chains", "dispatched"])
@pytest.mark.parametrize("side", [False, True], ids=["one round", "shared start"])
@pytest.mark.parametrize("outside", [True, False], ids=["outside states", "zero start"])
@pytest.mark.parametrize("pieces", list(ROUNDS.values()), ids=list(ROUNDS))
def test_fla_calls_match_call_by_call_bitwise(pieces, outside, side, own_kernels, recomputing, monkeypatch):
    """With the recurrences round by round on the chain kernels (`models.ops.kda.chains`, with the stock kernels'
    tuned configs that `tests/conftest.py` points fla at), and call by call through fla's dispatched wrappers, as
    where another fla backend is active (`models.ops.kda.recurrence`); and in a layer's recomputation, where both
    paths keep what their backward would compute again (`models.recompute.in_recomputed_part`): the same bits as
    when they recompute it. The outputs and the table are compared bitwise; the gradients too, but where two pieces
    start from one state the autograd loop adds its gradients in another order, and there they agree to rounding;
    the chains' gradients are bitwise the dispatched calls' everywhere (each entry's gradient is added in the same
    order, up to commuting one addition)."""
    from models.ops.kda import chains, chunk, tree_calls

    config = KDAConfig(num_heads=16, head_dim=128, chunk_size=B)  # ling-3-tiny's heads: kernels cached
    mixer = KimiDeltaAttention(config, hidden_size=256, eps=1e-5).cuda()
    calls = to_device(CoreCalls.build(layer_calls(pieces, outside, side), B, 4 if outside else 1), "cuda")
    T = sum(calls.call_rows)
    x = make_inputs(1, T, 16, 16, 128, 128, True, torch.float32, N=3)
    x["g"] = x["g"] * 0.1  # slow decay: states carry across chunks
    x = {n: (t if n == "initial_state" else t[0]).cuda().to(torch.float32 if n in ("g", "initial_state")
                                                              else torch.bfloat16) for n, t in x.items()}
    bf16, fp32 = (torch.empty(1, 1, 16, 128, dtype=d, device="meta") for d in (torch.bfloat16, torch.float32))
    if own_kernels and None in (chains.fwd_config(bf16, bf16, fp32, B), chains.bwd_config(bf16, bf16, fp32, B)):
        pytest.skip("no tuned configs of fla's recurrence kernels for this GPU (models/ops/fla_configs): the tree's "
                    "calls run the stock kernels call by call here, not the chains")

    def run(fused: bool, chain_kernels: bool = own_kernels):
        monkeypatch.setattr(tree_calls, "default_kernels_run", lambda name, kwargs: chain_kernels)
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        mixer.calls_op = type(mixer).calls_op if fused else None
        h0 = leaves["initial_state"] if outside else None
        o, table = mixer.core_calls(CoreInputs(*(leaves[n] for n in ("q", "k", "v", "g", "beta"))), calls, h0)
        gen = torch.Generator(device="cuda").manual_seed(3)
        loss = sum((t.float() * torch.randn(t.shape, generator=gen, device="cuda")).sum() for t in (o, table))
        names = [n for n in leaves if n != "initial_state" or outside]
        return o, table, dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))

    o_ref, table_ref, grads_ref = run(fused=False)
    for module in (chunk, tree_calls):
        monkeypatch.setattr(module, "in_recomputed_part", lambda: recomputing)
    o, table, grads = run(fused=True)
    o_kept, table_kept, grads_kept = run(fused=False)
    assert table.shape == (calls.table_size, 16, 128, 128)
    assert torch.equal(o, o_ref) and torch.equal(table, table_ref)
    assert torch.equal(o_kept, o_ref) and torch.equal(table_kept, table_ref)
    for name, g in grads_ref.items():
        if side:
            torch.testing.assert_close(grads[name], g, rtol=1e-2, atol=1e-3, msg=name)
        else:
            assert torch.equal(grads[name], g), name
        assert torch.equal(grads_kept[name], g), f"{name}, call by call, kept"
    if own_kernels:
        _, _, grads_dispatched = run(fused=True, chain_kernels=False)
        for name, g in grads_dispatched.items():
            assert torch.equal(grads[name], g), f"{name}, chains against dispatched calls"


@pytest.mark.parametrize("outside", [None, 2], ids=["none for three", "two for three"])
def test_calls_refuse_outside_states_that_do_not_match_the_table(outside):
    """Both paths (the call-by-call reference here, `fla_kda_calls` through the same `CoreCalls.check_outside`)
    refuse outside states other than the table's entries 1..Y."""
    calls = CoreCalls.build(layer_calls(ROUNDS["single call"]), B, table_start=4)
    mixer = KimiDeltaAttention(KDAConfig(num_heads=2, head_dim=8, chunk_size=B), hidden_size=16, eps=1e-5).double()
    T = sum(calls.call_rows)
    inputs = CoreInputs(*(torch.zeros(T, 2, *shape, dtype=torch.float64) for shape in ((8,), (8,), (8,), (8,), ())))
    states = None if outside is None else torch.zeros(outside, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="the calls read 3 outside state"):
        mixer.core_calls(inputs, calls, states)
