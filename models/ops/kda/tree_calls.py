"""fla fast path for a tree layer's KDA kernel calls (CUDA): fla's chunk kernels once over all calls, the two
state recurrences once per plan round.

Legend: T the calls' rows (call after call), P pieces (all calls' sequences), N_j call j's sequences, M state-table
entries, NT chunks, H query/key heads, HV value heads, K/V head dims.

A tree layer's linear attention is a sequence of kernel calls (tree execution builds them,
`models.tree.layout.CoreCalls`, and hands this op their arrays, `models.ops.kda.call_arrays`): call j packs pieces of
sequences cut at chunk boundaries, each piece starting from an entry of a state table (zeros, states from outside,
or an earlier call's final state: the same sequence's previous piece, or a side branch's chunk-aligned start). Of the
kernels behind `fla.ops.kda.chunk_kda`, only the forward state recurrence (`chunk_gated_delta_rule_fwd_h`) and its
backward (`chunk_gated_delta_rule_bwd_dhu`) carry anything from chunk to chunk. Everything else (the gate's cumsum, the
intra-chunk WY terms, the outputs, dq/dk/dv/dg) works chunk by chunk, so it runs once over all the calls' rows with
every piece as its own packed sequence. The recurrences run once per round of the plan (`models.ops.kda.chains`:
fla's kernels with each sequence's pieces as one chain, `ChainArrays`), in order forward and in reverse
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

from collections.abc import Sequence
from typing import NamedTuple

import torch

from models.ops.delta_rule.partition import check_delta_rule_shapes
from models.ops.kda.call_arrays import CallArrays, ChainArrays
from models.ops.kda.chunk import check_fla_kda_limits
from models.ops.kda.recurrence import (
    bwd_dhu_dispatched,
    bwd_dhu_kwargs,
    default_kernels_run,
    fwd_h_dispatched,
    fwd_h_kwargs,
)
from models.recompute import in_recomputed_part


class Kept(NamedTuple):
    """What backward otherwise computes again: the WY factors w, u `[1, T, HV, K|V]`, the gated q and k
    `[1, T, HV, K]`, the chunk states h `[1, NT, HV, K, V]` and the new values v_new `[1, T, HV, V]`."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor


class LayerCalls(NamedTuple):
    """A layer's calls as `fla_kda_calls` takes them, with the host bounds this module reads derived once (`of`)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    """[P+1] every piece of every call as one packed sequence of the calls' rows, with fla's chunk bookkeeping."""
    calls: Sequence[CallArrays]
    rounds: Sequence[ChainArrays]
    chunk_size: int
    row_bounds: list[int]
    """[m+1] where each call's rows start among all calls' rows, and their end."""
    chunk_bounds: list[int]
    """[m+1] where each call's chunks start among all calls' (fla's chunk order: call after call), and their end."""
    first_states: list[int]
    """[m] the table entry of each call's first final state (the others follow in piece order)."""
    outside: int
    """Y: the table entries from outside (1..Y)."""

    @property
    def table_size(self) -> int:
        """M = 1 + Y + P: zeros, the outside states, every piece's final state."""
        return self.outside + self.cu_seqlens.shape[0]

    @staticmethod
    def of(cu_seqlens, chunk_indices, chunk_offsets, calls: Sequence[CallArrays], rounds: Sequence[ChainArrays],
           chunk_size: int, outside: int) -> "LayerCalls":
        rows, chunks, firsts, entry = [0], [0], [], 1 + outside
        for call in calls:
            firsts.append(entry)
            entry += call.cu_seqlens_cpu.numel() - 1
            rows.append(rows[-1] + int(call.cu_seqlens_cpu[-1]))
            chunks.append(chunks[-1] + call.chunk_indices.shape[0])
        return LayerCalls(cu_seqlens, chunk_indices, chunk_offsets, calls, rounds, chunk_size, rows, chunks, firsts,
                          outside)


def _initial_states(table: torch.Tensor, call: CallArrays) -> torch.Tensor | None:
    """A call's initial states `[N_j, HV, K, V]` from the table: a view where they are one run of entries, else a
    gather; None for zeros."""
    return None if call.init_entries is None else table[call.init_entries]


def _recurrence(kg, w, u, g_cum, layer: LayerCalls, table: torch.Tensor, write_finals: bool):
    """The forward state recurrence: h `[1, NT, HV, K, V]`, v_new `[1, T, HV, V]`, each sequence starting from its
    entry of `table` `[M, HV, K, V]` fp32 and, with `write_finals`, the state after each piece written into it
    (backward's recomputation reads the table the forward filled). Round by round on the chain kernels
    (`models.ops.kda.chains`) where fla would run its stock kernels with tuned configs, else call by call through
    fla's dispatch (`models.ops.kda.recurrence`: another backend, or autotuned tiles), judged on the first call's
    arguments without its initial states (fla 0.6.0's backends judge by mode, flags, device and chunk bookkeeping,
    not by a call's sizes or states)."""
    from models.ops.kda.chains import fwd_config, fwd_h_chains

    rows, chunks, B = layer.row_bounds, layer.chunk_bounds, layer.chunk_size
    h = kg.new_empty(1, chunks[-1], u.shape[2], kg.shape[-1], u.shape[-1])
    v_new = torch.empty_like(u)

    def kwargs(j: int, states: bool = True) -> dict:
        call, piece = layer.calls[j], slice(rows[j], rows[j + 1])
        return fwd_h_kwargs(kg[:, piece], w[:, piece], u[:, piece], g_cum[:, piece],
                            _initial_states(table, call) if states else None, write_finals, call, B)

    config = fwd_config(kg, u, g_cum, B)
    if config is not None and default_kernels_run("chunk_gated_delta_rule_fwd_h", kwargs(0, states=False)):
        for chains in layer.rounds:
            fwd_h_chains(h, v_new, kg, w, u, g_cum, table, chains, B, write_finals, config)
        return h, v_new
    for j, call in enumerate(layer.calls):
        first = layer.first_states[j]
        finals = table[first : first + call.cu_seqlens_cpu.numel() - 1]
        fwd_h_dispatched(h[:, chunks[j] : chunks[j + 1]], v_new[:, rows[j] : rows[j + 1]],
                         finals if write_finals else None, kwargs(j))
    return h, v_new


def _recurrence_bwd(qg, kg, w, do, dv, g_cum, table, d_table, scale: float, layer: LayerCalls):
    """The backward state recurrence, in reverse: dh `[1, NT, HV, K, V]` (qg's dtype) and dv2 `[1, T, HV, V]`; each
    piece's state gradient starts from its table entry's gradient in `d_table` `[M, HV, K, V]` fp32, to which every
    sequence's initial-state gradient is added once its round has run (so a round sees the gradients of every later
    round that started from its states). Round by round on the chain kernels, or call by call as the forward."""
    from models.ops.kda.chains import bwd_config, bwd_dhu_chains

    rows, chunks, B = layer.row_bounds, layer.chunk_bounds, layer.chunk_size
    dh, dv2 = qg.new_empty(1, chunks[-1], *table.shape[1:]), torch.empty_like(dv)

    def kwargs(j: int, states: bool = True) -> dict:
        call, piece, first = layer.calls[j], slice(rows[j], rows[j + 1]), layer.first_states[j]
        dht = d_table[first : first + call.cu_seqlens_cpu.numel() - 1].contiguous()
        return bwd_dhu_kwargs(qg[:, piece], kg[:, piece], w[:, piece], do[:, piece], dv[:, piece], g_cum[:, piece],
                              _initial_states(table, call) if states else None, dht, scale, call, B)

    config = bwd_config(qg, do, g_cum, B)
    if config is not None and default_kernels_run("chunk_gated_delta_rule_bwd_dhu", kwargs(0, states=False)):
        for chains in reversed(layer.rounds):
            dh0 = bwd_dhu_chains(dh, dv2, qg, kg, w, do, dv, g_cum, d_table, scale, chains, B, config)
            _add_initial_gradients(d_table, chains.grad_entries, dh0)
        return dh, dv2
    for j in reversed(range(len(layer.calls))):
        call = layer.calls[j]
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


def kda_calls_fwd(q, k, v, g, beta, scale: float, outside, layer: LayerCalls, keep: bool = False):
    """Forward of a layer's calls: q, k `[1, T, H, K]`, v `[1, T, HV, V]`, g `[1, T, HV, K]` (log decay), beta
    `[1, T, HV]`, outside `[Y, HV, K, V]` fp32 or None. Returns o `[1, T, HV, V]`, the state table `[M, HV, K, V]`
    fp32 and for backward the gate's chunk cumsum, Aqk, Akk and, with `keep`, `Kept` (None without)."""
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    B, packed = layer.chunk_size, dict(cu_seqlens=layer.cu_seqlens, chunk_indices=layer.chunk_indices)
    g_cum = chunk_local_cumsum(g=g, scale=RCP_LN2, chunk_size=B, **packed)
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, chunk_size=B,
                                                 disable_recompute=keep, **packed)
    table = q.new_empty(layer.table_size, *u.shape[2:3], q.shape[-1], u.shape[-1], dtype=torch.float32)
    table[0].zero_()
    if outside is not None:
        table[1 : 1 + outside.shape[0]] = outside
    h, v_new = _recurrence(kg, w, u, g_cum, layer, table, write_finals=True)
    o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, chunk_size=B, **packed)
    return o, table, g_cum, Aqk, Akk, Kept(w, u, qg, kg, h, v_new) if keep else None


def kda_calls_bwd(q, k, v, g_cum, beta, Aqk, Akk, table, scale: float, do, d_table, layer: LayerCalls,
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

    B, packed = layer.chunk_size, dict(cu_seqlens=layer.cu_seqlens, chunk_indices=layer.chunk_indices)
    if kept is None:
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, **packed)
        h, v_new = _recurrence(kg, w, u, g_cum, layer, table, write_finals=False)
    else:
        w, u, qg, kg, h, v_new = kept
    dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=B, **packed)
    dh, dv2 = _recurrence_bwd(qg, kg, w, do, dv, g_cum, table, d_table, scale, layer)
    dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
        q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv2,
        scale=scale, chunk_size=B, chunk_offsets=layer.chunk_offsets, **packed,
    )
    dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                         dg=dg, chunk_size=B, **packed)
    H, HV = q.shape[2], v.shape[2]
    if HV > H:  # as fla: value-head gradients summed per query/key head (our KDA has HV == H)
        dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, **packed)
    Y = layer.outside
    return dq, dk, dv, dg, db, d_table[1 : 1 + Y] if Y else None


class KDACallsFunction(torch.autograd.Function):
    """`kda_calls_fwd` / `kda_calls_bwd` under autograd, on the inputs' device. In a layer that backward
    recomputes (`models.recompute.in_recomputed_part`) it saves `Kept`, as `models.ops.kda.chunk` has fla do."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, outside, layer, scale):
        keep = in_recomputed_part()
        with torch.cuda.device(q.device):
            o, table, g_cum, Aqk, Akk, kept = kda_calls_fwd(q, k, v, g, beta, scale, outside, layer, keep)
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, table, *(kept or ()))
        ctx.layer, ctx.scale, ctx.g_dtype, ctx.kept = layer, scale, g.dtype, keep
        ctx.set_materialize_grads(False)  # the tree mixer drops the table: no zero gradient made for it
        return o.type_as(q), table

    @staticmethod
    def backward(ctx, do, d_table):
        q, k, v, g_cum, beta, Aqk, Akk, table, *rest = ctx.saved_tensors
        do = torch.zeros_like(q, dtype=v.dtype) if do is None else do
        d_table = torch.zeros_like(table) if d_table is None else d_table.clone(memory_format=torch.contiguous_format)
        with torch.cuda.device(q.device):
            dq, dk, dv, dg, db, d_outside = kda_calls_bwd(
                q, k, v, g_cum, beta, Aqk, Akk, table, ctx.scale, do.contiguous(), d_table, ctx.layer,
                Kept(*rest) if ctx.kept else None,
            )
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), d_outside, None, None


def fla_kda_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  outside: torch.Tensor | None, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor,
                  chunk_offsets: torch.Tensor, calls: Sequence[CallArrays], rounds: Sequence[ChainArrays],
                  chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KDA kernel calls on fla's kernels (the fast path of `LinearAttention.core_calls`, its `calls_op`).

    Args:
        q, k: `[T, H, K]` the calls' rows, call after call, L2-normalised; v `[T, HV, V]`; g `[T, HV, K]` log decay;
            beta `[T, HV]` (as `models.linear_attention.CoreInputs`).
        outside: `[Y, HV, K, V]` fp32 table entries 1..Y, None when there are none.
        cu_seqlens: `[P+1]` int64 every piece of every call as one packed sequence of the calls' rows, on q's device;
            chunk_indices, chunk_offsets: fla's chunk bookkeeping of it for `chunk_size`
            (`models.ops.delta_rule.fla_args.fla_chunk_arrays`).
        calls: each call's arrays, in order (`CallArrays`, made for `chunk_size`).
        rounds: each plan round's chains, in order (`ChainArrays`).
        chunk_size: 32 or 64, the chunk size the arrays were made for.
    Returns: (o `[T, HV, V]` in v's dtype, the state table `[M, HV, K, V]` fp32, M = 1 + Y + P).
    """
    check_fla_kda_limits(chunk_size, q.shape[-1])
    Y = 0 if outside is None else outside.shape[0]
    q, k, v_, g, beta = (t[None].contiguous() for t in (q, k, v, g, beta))
    check_delta_rule_shapes(q, k, v_, g, beta, outside, Y, True)
    outside = None if outside is None else outside.float().contiguous()
    layer = LayerCalls.of(cu_seqlens, chunk_indices, chunk_offsets, calls, rounds, chunk_size, Y)
    o, table = KDACallsFunction.apply(q, k, v_, g, beta, outside, layer, q.shape[-1] ** -0.5)
    return o[0].to(v.dtype), table
