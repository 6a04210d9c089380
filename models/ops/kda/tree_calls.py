"""fla fast path for a tree layer's KDA kernel calls (CUDA): fla's chunk kernels once over all calls, the two
state recurrences once per plan round.

Legend: T the calls' rows (call after call), P pieces (all calls' sequences), N_j call j's sequences, M state-table
entries, NT chunks, H query/key heads, HV value heads, K/V head dims.

A tree layer's linear attention is the calls of `models.tree.layout.CoreCalls`: call j packs pieces of sequences cut
at chunk boundaries, each piece starting from an entry of a state table (zeros, states from outside, or an earlier
call's final state: the same sequence's previous piece, or a side branch's chunk-aligned start). Of the kernels
behind `fla.ops.kda.chunk_kda`, only the forward state recurrence (`chunk_gated_delta_rule_fwd_h`) and its backward
(`chunk_gated_delta_rule_bwd_dhu`) carry anything from chunk to chunk. Everything else (the gate's cumsum, the
intra-chunk WY terms, the outputs, dq/dk/dv/dg) works chunk by chunk, so it runs once over all the calls' rows with
every piece as its own packed sequence. The recurrences run once per round of the plan (`models.ops.kda.chains`:
fla's kernels with each sequence's pieces as one chain, `CoreCalls.chains`), in order forward and in reverse
backward: each sequence starts from its table entry, the state after each of its pieces is written to the piece's
entry, and backward adds each sequence's initial-state gradient into the table's gradient, which a piece's state
gradient starts from in an earlier round. Where fla's dispatch would run another implementation of the recurrences,
or would autotune them (no tuned config for flat's call: the chains could not know the tiles it picks), they run
call by call through fla's dispatch (`models.ops.kda.recurrence`). Chunk states and values are written into the
layer's buffers in place. The forward's kernels see exactly the chunks and states that `chunk_kda` call by call
gives them, so the outputs and states are the same, bit for bit (`tests/models/ops/test_kda_calls.py` on a GPU:
bench/RESULTS.md, "GPU: CUDA tests"; the chains are checked without a GPU by `test_kda_chains.py`).
In a layer that backward recomputes (`models.recompute.in_recomputed_part`) the forward saves the WY factors, gated
q/k, chunk states and new values (`Kept`), as `models.ops.kda.chunk` has fla save them, so backward runs neither
`recompute_w_u_fwd` nor the forward recurrence again.

Host cost: fla's `chunk_kda` launches about 7 kernels forward and 10 backward per call, each through its Python
dispatch; here it is about 7 and 10 per layer plus, per round, the recurrence and, in backward, the add of its
sequences' initial-state gradients into the table's (one add where they are one run of entries, else a sorted
add). Tree layers on SWE-like steps hold up to 27 calls of a few hundred rows each (SWE seed 5 at scale 0.01;
seed 0: 14 calls in 2 rounds), where the host, not the GPU, set the pace. One autograd Function for all calls
also leaves no per-round concatenation of outputs and input gradients.

Reference: the call-by-call loop `models.linear_attention.LinearAttention.core_calls`. The fla calls mirror
`fla.ops.kda.chunk_fwd.chunk_kda_fwd` and `fla.ops.kda.chunk_bwd.chunk_kda_bwd` (fla 0.6.0) with our flags: gates and
beta activated outside, q/k normalised, K-first fp32 states, no context parallelism, no CUDA graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from models.ops.delta_rule.partition import check_delta_rule_shapes
from models.ops.kda.chunk import check_fla_kda_limits
from models.ops.kda.recurrence import (
    bwd_dhu_dispatched, bwd_dhu_kwargs, default_kernels_run, fwd_h_dispatched, fwd_h_kwargs,
)
from models.recompute import in_recomputed_part

if TYPE_CHECKING:
    from models.tree.layout import CoreCalls


class Kept(NamedTuple):
    """What backward otherwise computes again: the WY factors w, u `[1, T, HV, K|V]`, the gated q and k
    `[1, T, HV, K]`, the chunk states h `[1, NT, HV, K, V]` and the new values v_new `[1, T, HV, V]`."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor


def _initial_states(table: torch.Tensor, call) -> torch.Tensor | None:
    """A call's initial states `[N_j, HV, K, V]` from the table: a view where they are one run of entries, else a
    gather; None for zeros."""
    return None if call.init_entries is None else table[call.init_entries]


def _recurrence(kg, w, u, g_cum, calls: CoreCalls, table: torch.Tensor, write_finals: bool):
    """The forward state recurrence: h `[1, NT, HV, K, V]`, v_new `[1, T, HV, V]`, each sequence starting from its
    entry of `table` `[M, HV, K, V]` fp32 and, with `write_finals`, the state after each piece written into it
    (backward's recomputation reads the table the forward filled). Round by round on the chain kernels
    (`models.ops.kda.chains`) where fla would run its stock kernels with tuned configs, else call by call through
    fla's dispatch (`models.ops.kda.recurrence`: another backend, or autotuned tiles), judged on the first call's
    arguments without its initial states (fla 0.6.0's backends judge by mode, flags, device and chunk bookkeeping,
    not by a call's sizes or states)."""
    from models.ops.kda.chains import fwd_config, fwd_h_chains

    rows, chunks = calls.row_bounds, calls.chunk_bounds
    h = kg.new_empty(1, chunks[-1], u.shape[2], kg.shape[-1], u.shape[-1])
    v_new = torch.empty_like(u)

    def kwargs(j: int, states: bool = True) -> dict:
        call, piece = calls.calls[j], slice(rows[j], rows[j + 1])
        return fwd_h_kwargs(kg[:, piece], w[:, piece], u[:, piece], g_cum[:, piece],
                            _initial_states(table, call) if states else None, write_finals, call, calls.chunk_size)

    config = fwd_config(kg, u, g_cum, calls.chunk_size)
    if config is not None and default_kernels_run("chunk_gated_delta_rule_fwd_h", kwargs(0, states=False)):
        for chains in calls.chains:
            fwd_h_chains(h, v_new, kg, w, u, g_cum, table, chains, calls.chunk_size, write_finals, config)
        return h, v_new
    for j, call in enumerate(calls.calls):
        finals = table[call.first_state : call.first_state + call.cu_seqlens_cpu.numel() - 1]
        fwd_h_dispatched(h[:, chunks[j] : chunks[j + 1]], v_new[:, rows[j] : rows[j + 1]],
                         finals if write_finals else None, kwargs(j))
    return h, v_new


def _recurrence_bwd(qg, kg, w, do, dv, g_cum, table, d_table, scale: float, calls: CoreCalls):
    """The backward state recurrence, in reverse: dh `[1, NT, HV, K, V]` (qg's dtype) and dv2 `[1, T, HV, V]`; each
    piece's state gradient starts from its table entry's gradient in `d_table` `[M, HV, K, V]` fp32, to which every
    sequence's initial-state gradient is added once its round has run (so a round sees the gradients of every later
    round that started from its states). Round by round on the chain kernels, or call by call as the forward."""
    from models.ops.kda.chains import bwd_config, bwd_dhu_chains

    rows, chunks = calls.row_bounds, calls.chunk_bounds
    dh, dv2 = qg.new_empty(1, chunks[-1], *table.shape[1:]), torch.empty_like(dv)

    def kwargs(j: int, states: bool = True) -> dict:
        call, piece = calls.calls[j], slice(rows[j], rows[j + 1])
        dht = d_table[call.first_state : call.first_state + call.cu_seqlens_cpu.numel() - 1].contiguous()
        return bwd_dhu_kwargs(qg[:, piece], kg[:, piece], w[:, piece], do[:, piece], dv[:, piece], g_cum[:, piece],
                              _initial_states(table, call) if states else None, dht, scale, call, calls.chunk_size)

    config = bwd_config(qg, do, g_cum, calls.chunk_size)
    if config is not None and default_kernels_run("chunk_gated_delta_rule_bwd_dhu", kwargs(0, states=False)):
        for chains in reversed(calls.chains):
            dh0 = bwd_dhu_chains(dh, dv2, qg, kg, w, do, dv, g_cum, d_table, scale, chains, calls.chunk_size, config)
            _add_initial_gradients(d_table, chains.grad_entries, dh0)
        return dh, dv2
    for j in reversed(range(len(calls.calls))):
        call = calls.calls[j]
        dh0 = bwd_dhu_dispatched(dh[:, chunks[j] : chunks[j + 1]], dv2[:, rows[j] : rows[j + 1]], kwargs(j))
        if dh0 is not None:
            _add_initial_gradients(d_table, call.init_entries, dh0)
    return dh, dv2


def _add_initial_gradients(d_table: torch.Tensor, entries: torch.Tensor | slice | None, dh0: torch.Tensor) -> None:
    """Add initial-state gradients dh0 `[N, HV, K, V]` to their entries of d_table: one add where the entries are a
    run (a slice), a sorted accumulation where they are an index (deterministic where sequences share a start)."""
    if isinstance(entries, slice):
        d_table[entries] += dh0
    elif entries is not None:
        d_table.index_put_((entries,), dh0, accumulate=True)


def kda_calls_fwd(q, k, v, g, beta, scale: float, outside, calls: CoreCalls, keep: bool = False):
    """Forward of a layer's calls: q, k `[1, T, H, K]`, v `[1, T, HV, V]`, g `[1, T, HV, K]` (log decay), beta
    `[1, T, HV]`, outside `[Y, HV, K, V]` fp32 or None. Returns o `[1, T, HV, V]`, the state table `[M, HV, K, V]`
    fp32 and for backward the gate's chunk cumsum, Aqk, Akk and, with `keep`, `Kept` (None without)."""
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    B, packed = calls.chunk_size, dict(cu_seqlens=calls.cu_seqlens, chunk_indices=calls.chunk_indices)
    g_cum = chunk_local_cumsum(g=g, scale=RCP_LN2, chunk_size=B, **packed)
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, chunk_size=B,
                                                 disable_recompute=keep, **packed)
    table = q.new_empty(calls.table_size, *u.shape[2:3], q.shape[-1], u.shape[-1], dtype=torch.float32)
    table[0].zero_()
    if outside is not None:
        table[1 : 1 + outside.shape[0]] = outside
    h, v_new = _recurrence(kg, w, u, g_cum, calls, table, write_finals=True)
    o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, chunk_size=B, **packed)
    return o, table, g_cum, Aqk, Akk, Kept(w, u, qg, kg, h, v_new) if keep else None


def kda_calls_bwd(q, k, v, g_cum, beta, Aqk, Akk, table, scale: float, do, d_table, calls: CoreCalls,
                  kept: Kept | None = None):
    """Backward of a layer's calls from `kda_calls_fwd`'s saved tensors, do `[1, T, HV, V]` and d_table
    `[M, HV, K, V]` fp32 (the table's incoming gradient; updated in place): (dq, dk, dv, dg, dbeta, d outside or
    None). A piece's state gradient starts from its entry's gradient once every later round has added its
    initial-state gradients to the entries it read. Without `kept` the WY factors and the forward recurrence run again
    (as fla's backward does)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    B, packed = calls.chunk_size, dict(cu_seqlens=calls.cu_seqlens, chunk_indices=calls.chunk_indices)
    if kept is None:
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, **packed)
        h, v_new = _recurrence(kg, w, u, g_cum, calls, table, write_finals=False)
    else:
        w, u, qg, kg, h, v_new = kept
    dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=B, **packed)
    dh, dv2 = _recurrence_bwd(qg, kg, w, do, dv, g_cum, table, d_table, scale, calls)
    dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
        q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv2,
        scale=scale, chunk_size=B, chunk_offsets=calls.chunk_offsets, **packed,
    )
    dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                         dg=dg, chunk_size=B, **packed)
    H, HV = q.shape[2], v.shape[2]
    if HV > H:  # as fla: value-head gradients summed per query/key head (our KDA has HV == H)
        dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, **packed)
    Y = calls.outside_states
    return dq, dk, dv, dg, db, d_table[1 : 1 + Y] if Y else None


class KDACallsFunction(torch.autograd.Function):
    """`kda_calls_fwd` / `kda_calls_bwd` under autograd, on the inputs' device. In a layer that backward
    recomputes (`models.recompute.in_recomputed_part`) it saves `Kept`, as `models.ops.kda.chunk` has fla do."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, outside, calls, scale):
        keep = in_recomputed_part()
        with torch.cuda.device(q.device):
            o, table, g_cum, Aqk, Akk, kept = kda_calls_fwd(q, k, v, g, beta, scale, outside, calls, keep)
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, table, *(kept or ()))
        ctx.calls, ctx.scale, ctx.g_dtype, ctx.kept = calls, scale, g.dtype, keep
        ctx.set_materialize_grads(False)  # the tree mixer drops the table: no zero gradient made for it
        return o.type_as(q), table

    @staticmethod
    def backward(ctx, do, d_table):
        q, k, v, g_cum, beta, Aqk, Akk, table, *rest = ctx.saved_tensors
        do = torch.zeros_like(q, dtype=v.dtype) if do is None else do
        d_table = torch.zeros_like(table) if d_table is None else d_table.clone(memory_format=torch.contiguous_format)
        with torch.cuda.device(q.device):
            dq, dk, dv, dg, db, d_outside = kda_calls_bwd(
                q, k, v, g_cum, beta, Aqk, Akk, table, ctx.scale, do.contiguous(), d_table, ctx.calls,
                Kept(*rest) if ctx.kept else None,
            )
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), d_outside, None, None


def fla_kda_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  calls: CoreCalls, outside: torch.Tensor | None, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`LinearAttention.core_calls` on fla's kernels (its `calls_op`).

    Args:
        q, k: `[T, H, K]` the calls' rows, L2-normalised; v `[T, HV, V]`; g `[T, HV, K]` log decay; beta `[T, HV]`
            (as `models.linear_attention.CoreInputs`).
        calls: the layer's calls (`models.tree.layout.CoreCalls`), planned for `chunk_size` (32 or 64).
        outside: `[Y, HV, K, V]` fp32 table entries 1..Y, None when there are none.
    Returns: (o `[T, HV, V]` in v's dtype, the state table `[M, HV, K, V]` fp32).
    """
    if chunk_size != calls.chunk_size:
        raise ValueError(f"the calls are planned for chunk size {calls.chunk_size} and the mixer runs {chunk_size}; "
                         "the fla KDA path needs them equal")
    check_fla_kda_limits(chunk_size, q.shape[-1])
    Y = calls.check_outside(outside)
    q, k, v_, g, beta = (t[None].contiguous() for t in (q, k, v, g, beta))
    check_delta_rule_shapes(q, k, v_, g, beta, outside, Y, True)
    outside = None if outside is None else outside.float().contiguous()
    o, table = KDACallsFunction.apply(q, k, v_, g, beta, outside, calls, q.shape[-1] ** -0.5)
    return o[0].to(v.dtype), table
