"""fla fast path for one round of tree execution's KDA calls (CUDA): fla's chunk kernels once over the round, only
the two state recurrences call by call.

Legend: T the round's rows (its calls' rows, call after call), P pieces (all calls' sequences), N_j call j's
sequences, NT chunks, H query/key heads, HV value heads, K/V head dims.

A round (`models.tree.layout.CoreRound`) is calls 0..m-1: call j packs piece j of every sequence that has one, the
pieces cut at chunk boundaries, piece j > 0 starting from the final state of the same sequence's piece j-1. Of the
kernels behind `fla.ops.kda.chunk_kda`, only the forward state recurrence (`chunk_gated_delta_rule_fwd_h`) and its
backward (`chunk_gated_delta_rule_bwd_dhu`) carry anything from chunk to chunk. Everything else (the gate's cumsum,
the intra-chunk WY terms, the outputs, dq/dk/dv/dg) works chunk by chunk, so it runs once over the round's rows with
every piece as its own packed sequence. The recurrences run per call, in order forward and in reverse backward, each
piece's final-state gradient plus the initial-state gradient of its continuation as `dht`, writing their chunk states
and values into the round's buffers in place (`models.ops.kda.recurrence`: no per-call output is concatenated). Each
kernel then sees exactly the chunks and states that `chunk_kda` call by call gives it, so the results are the same,
bit for bit (`tests/models/ops/test_kda_round.py` on the H200, the in-place writes and the dispatched wrappers
alike, bench/RESULTS.md session 17). In a layer that backward recomputes
(`models.recompute.in_recomputed_part`) the forward saves the WY factors, gated q/k, chunk states and new values
(`Kept`), as `models.ops.kda.chunk` has fla save them, so backward runs neither `recompute_w_u_fwd` nor the forward
recurrence again.

Host cost: fla's `chunk_kda` launches about 7 kernels forward and 10 backward per call, each through its Python
dispatch; here it is about 7 and 10 per round plus 1 forward and 2 backward per call. Tree rounds on SWE-like steps
hold up to 27 calls of a few hundred rows each (issue #17), where the host, not the GPU, set the pace.

Reference: the call-by-call loop `models.linear_attention.LinearAttention.core_round`. The fla calls mirror
`fla.ops.kda.chunk_fwd.chunk_kda_fwd` and `fla.ops.kda.chunk_bwd.chunk_kda_bwd` (fla 0.6.0) with our flags: gates and
beta activated outside, q/k normalised, K-first fp32 states, no context parallelism, no CUDA graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from models.ops.delta_rule.partition import check_delta_rule_shapes
from models.ops.kda.chunk import check_fla_kda_limits
from models.ops.kda.recurrence import bwd_dhu_into, fwd_h_into
from models.recompute import in_recomputed_part

if TYPE_CHECKING:
    from models.tree.layout import CoreRound


class Kept(NamedTuple):
    """What a round's backward otherwise computes again: the WY factors w, u `[1, T, HV, K|V]`, the gated q and k
    `[1, T, HV, K]`, the chunk states h `[1, NT, HV, K, V]` and the new values v_new `[1, T, HV, V]`."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor


def _recurrence(kg, w, u, g_cum, rnd: CoreRound, initial_state=None, inits=None):
    """The forward state recurrence call by call: h `[1, NT, HV, K, V]`, v_new `[1, T, HV, V]` (each call writing
    its chunks and rows in place, `models.ops.kda.recurrence`), and per call its initial states `[N_j, HV, K, V]`
    (None = zeros) and final states. Forward: from `initial_state` (the round's), each later call from the previous
    call's final states. Backward's recomputation: from the saved per-call `inits`, no final states."""
    starts, finals = [], []
    rows, chunks = rnd.row_bounds, rnd.chunk_bounds
    h = kg.new_empty(1, chunks[-1], u.shape[2], kg.shape[-1], u.shape[-1])
    v_new = torch.empty_like(u)
    for j, call in enumerate(rnd.calls):
        piece, part = slice(rows[j], rows[j + 1]), slice(chunks[j], chunks[j + 1])
        h0 = inits[j] if inits is not None else call.initial_states(initial_state, finals[-1] if finals else None)
        final = fwd_h_into(
            h[:, part], v_new[:, piece], k=kg[:, piece], w=w[:, piece], u=u[:, piece], gk=g_cum[:, piece],
            initial_state=h0, output_final_state=inits is None, cu_seqlens=call.cu_seqlens,
            cu_seqlens_cpu=call.cu_seqlens_cpu, chunk_indices=call.chunk_indices, chunk_offsets=call.chunk_offsets,
            chunk_size=rnd.chunk_size,
        )
        starts.append(h0)
        finals.append(final)
    return h, v_new, starts, finals


def kda_round_fwd(q, k, v, g, beta, scale: float, initial_state, rnd: CoreRound, keep: bool = False):
    """Forward of a round: q, k `[1, T, H, K]`, v `[1, T, HV, V]`, g `[1, T, HV, K]` (log decay), beta `[1, T, HV]`,
    initial_state `[N_0, HV, K, V]` fp32 or None. Returns o `[1, T, HV, V]`, the final state of every piece
    `[P, HV, K, V]` fp32, and for backward the gate's chunk cumsum, Aqk, Akk, each call's initial states and, with
    `keep`, `Kept` (what backward would otherwise compute again; None without)."""
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    B, packed = rnd.chunk_size, dict(cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices)
    g_cum = chunk_local_cumsum(g=g, scale=RCP_LN2, chunk_size=B, **packed)
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, chunk_size=B,
                                                 disable_recompute=keep, **packed)
    h, v_new, inits, finals = _recurrence(kg, w, u, g_cum, rnd, initial_state=initial_state)
    o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, chunk_size=B, **packed)
    return o, torch.cat(finals), g_cum, Aqk, Akk, inits, Kept(w, u, qg, kg, h, v_new) if keep else None


def kda_round_bwd(q, k, v, g_cum, beta, Aqk, Akk, inits, scale: float, do, d_finals, rnd: CoreRound,
                  kept: Kept | None = None):
    """Backward of a round from `kda_round_fwd`'s saved tensors, do `[1, T, HV, V]` and d_finals `[P, HV, K, V]`:
    (dq, dk, dv, dg, dbeta, d initial_state or None). Call j's `dht` is its pieces' final-state gradient plus, where a
    piece continues in call j+1, that continuation's initial-state gradient. Without `kept` the WY factors and the
    forward recurrence run again (as fla's backward does)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    B, packed = rnd.chunk_size, dict(cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices)
    if kept is None:
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, **packed)
        h, v_new, _, _ = _recurrence(kg, w, u, g_cum, rnd, inits=inits)
    else:
        w, u, qg, kg, h, v_new = kept
    dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=B, **packed)
    rows, chunks, states = rnd.row_bounds, rnd.chunk_bounds, rnd.final_bounds
    dh, dv2 = torch.empty_like(h, dtype=qg.dtype), torch.empty_like(dv)
    dh0 = None
    for j in reversed(range(len(rnd.calls))):
        call, piece, part = rnd.calls[j], slice(rows[j], rows[j + 1]), slice(chunks[j], chunks[j + 1])
        dht = d_finals[states[j] : states[j + 1]]
        if dh0 is not None:
            later = rnd.calls[j + 1].previous
            dht = dht + dh0 if later is None else dht.index_add(0, later, dh0)
        dh0 = bwd_dhu_into(
            dh[:, part], dv2[:, piece], q=qg[:, piece], k=kg[:, piece], w=w[:, piece], do=do[:, piece],
            dv=dv[:, piece], gk=g_cum[:, piece], h0=inits[j], dht=dht.contiguous(), scale=scale,
            cu_seqlens=call.cu_seqlens, chunk_indices=call.chunk_indices, chunk_offsets=call.chunk_offsets,
            chunk_size=B,
        )
    dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
        q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv2,
        scale=scale, chunk_size=B, chunk_offsets=rnd.chunk_offsets, **packed,
    )
    dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                         dg=dg, chunk_size=B, **packed)
    H, HV = q.shape[2], v.shape[2]
    if HV > H:  # as fla: value-head gradients summed per query/key head (our KDA has HV == H)
        dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, **packed)
    return dq, dk, dv, dg, db, dh0


class KDARoundFunction(torch.autograd.Function):
    """`kda_round_fwd` / `kda_round_bwd` under autograd, on the inputs' device. In a layer that backward
    recomputes (`models.recompute.in_recomputed_part`) it saves `Kept`, as `models.ops.kda.chunk` has fla do."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, rnd, scale):
        keep = in_recomputed_part()
        with torch.cuda.device(q.device):
            o, finals, g_cum, Aqk, Akk, inits, kept = kda_round_fwd(q, k, v, g, beta, scale, initial_state, rnd, keep)
        starts = [x for x in inits if x is not None]
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, *(kept or ()), *starts)
        ctx.zero_start, ctx.rnd, ctx.scale, ctx.g_dtype, ctx.kept = initial_state is None, rnd, scale, g.dtype, keep
        return o.type_as(q), finals

    @staticmethod
    def backward(ctx, do, d_finals):
        q, k, v, g_cum, beta, Aqk, Akk, *rest = ctx.saved_tensors
        kept = Kept(*rest[:len(Kept._fields)]) if ctx.kept else None
        inits = rest[len(Kept._fields):] if ctx.kept else rest
        with torch.cuda.device(q.device):
            dq, dk, dv, dg, db, dh0 = kda_round_bwd(
                q, k, v, g_cum, beta, Aqk, Akk, [None, *inits] if ctx.zero_start else inits, ctx.scale,
                do.contiguous(), d_finals, ctx.rnd, kept,
            )
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0, None, None


def fla_kda_round(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  rnd: CoreRound, initial_state: torch.Tensor | None, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`LinearAttention.core_round` on fla's kernels (its `round_op`).

    Args:
        q, k: `[T, H, K]` the round's rows, L2-normalised; v `[T, HV, V]`; g `[T, HV, K]` log decay; beta `[T, HV]`
            (as `models.linear_attention.CoreInputs`).
        rnd: the round's calls (`models.tree.layout.CoreRound`), planned for `chunk_size` (32 or 64).
        initial_state: `[N_0, HV, K, V]` fp32 state of each of the round's sequences, None = zeros.
    Returns: (o `[T, HV, V]` in v's dtype, the final state of every piece `[P, HV, K, V]` fp32, call after call).
    """
    if chunk_size != rnd.chunk_size:
        raise ValueError(f"the round is planned for chunk size {rnd.chunk_size} and the mixer runs {chunk_size}; "
                         "the fla KDA path needs them equal")
    check_fla_kda_limits(chunk_size, q.shape[-1])
    q, k, v_, g, beta = (t[None].contiguous() for t in (q, k, v, g, beta))
    check_delta_rule_shapes(q, k, v_, g, beta, initial_state, rnd.calls[0].cu_seqlens_cpu.numel() - 1, True)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, finals = KDARoundFunction.apply(q, k, v_, g, beta, h0, rnd, q.shape[-1] ** -0.5)
    return o[0].to(v.dtype), finals
