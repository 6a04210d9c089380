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
piece's final-state gradient plus the initial-state gradient of its continuation as `dht`. Each kernel then sees
exactly the chunks and states that `chunk_kda` call by call gives it, so the results are the same, bit for bit
(measured on the H200: `tests/models/ops/test_kda_round.py`).

Host cost: fla's `chunk_kda` launches about 7 kernels forward and 10 backward per call, each through its Python
dispatch; here it is about 7 and 10 per round plus 1 forward and 2 backward per call. Tree rounds on SWE-like steps
hold up to 27 calls of a few hundred rows each (issue #17), where the host, not the GPU, set the pace.

Reference: the call-by-call loop `models.linear_attention.LinearAttention.core_round`. The fla calls mirror
`fla.ops.kda.chunk_fwd.chunk_kda_fwd` and `fla.ops.kda.chunk_bwd.chunk_kda_bwd` (fla 0.6.0) with our flags: gates and
beta activated outside, q/k normalised, K-first fp32 states, no context parallelism, no CUDA graphs.
"""

from __future__ import annotations

import torch


def _recurrence(kg, w, u, g, rnd, initial_state=None, inits=None):
    """The forward state recurrence call by call: h `[1, NT, HV, K, V]`, v_new `[1, T, HV, V]`, and per call its
    initial states (None = zeros) and final states. Forward: from `initial_state` (the round's), each later call
    from the previous call's final states. Backward's recomputation: from the saved per-call `inits`, no finals."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    hs, v_news, starts, finals = [], [], [], []
    start = 0
    for j, (call, rows) in enumerate(zip(rnd.calls, rnd.call_rows)):
        piece = slice(start, start + rows)
        if inits is not None:
            h0 = inits[j]
        else:
            h0 = initial_state if j == 0 else finals[-1] if call.previous is None else finals[-1][call.previous]
        h, v_new, final = chunk_gated_delta_rule_fwd_h(
            k=kg[:, piece], w=w[:, piece], u=u[:, piece], gk=g[:, piece], initial_state=h0,
            output_final_state=inits is None, cu_seqlens=call.cu_seqlens, cu_seqlens_cpu=call.cu_seqlens_cpu,
            chunk_indices=call.chunk_indices, chunk_offsets=call.chunk_offsets, chunk_size=rnd.chunk_size,
        )
        hs.append(h)
        v_news.append(v_new)
        starts.append(h0)
        finals.append(final)
        start += rows
    return _along_t(hs), _along_t(v_news), starts, finals


def _along_t(xs: list[torch.Tensor]) -> torch.Tensor:
    """Per-call tensors `[1, T_j or NT_j, ...]` as the round's."""
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)


class _KDARound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, rnd, scale):
        from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        B, packed = rnd.chunk_size, dict(cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices)
        g_cum = chunk_local_cumsum(g=g, scale=RCP_LN2, chunk_size=B, **packed)
        w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, chunk_size=B,
                                                    **packed)
        h, v_new, inits, finals = _recurrence(kg, w, u, g_cum, rnd, initial_state=initial_state)
        o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, chunk_size=B, **packed)
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, *(x for x in inits if x is not None))
        ctx.zero_start, ctx.rnd, ctx.scale, ctx.g_dtype = initial_state is None, rnd, scale, g.dtype
        return o.type_as(q), torch.cat(finals)

    @staticmethod
    def backward(ctx, do, d_finals):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
        from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
        from fla.ops.kda.wy_fast import recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, g_cum, beta, Aqk, Akk, *inits = ctx.saved_tensors
        rnd, scale = ctx.rnd, ctx.scale
        inits = [None, *inits] if ctx.zero_start else inits
        B, packed = rnd.chunk_size, dict(cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices)
        do = do.contiguous()
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, **packed)
        h, v_new, _, _ = _recurrence(kg, w, u, g_cum, rnd, inits=inits)
        dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=B, **packed)
        bounds, first_final = rnd.row_bounds, rnd.final_bounds
        dhs, dvs = [None] * len(rnd.calls), [None] * len(rnd.calls)
        dh0 = None
        for j in reversed(range(len(rnd.calls))):
            call, piece = rnd.calls[j], slice(bounds[j], bounds[j + 1])
            dht = d_finals[first_final[j] : first_final[j + 1]]
            if dh0 is not None:  # the continuation's initial-state gradient reaches this piece's final state
                nxt = rnd.calls[j + 1].previous
                dht = dht + dh0 if nxt is None else dht.index_add(0, nxt, dh0)
            dhs[j], dh0, dvs[j] = chunk_gated_delta_rule_bwd_dhu(
                q=qg[:, piece], k=kg[:, piece], w=w[:, piece], do=do[:, piece], dv=dv[:, piece], gk=g_cum[:, piece],
                h0=inits[j], dht=dht.contiguous(), scale=scale, cu_seqlens=call.cu_seqlens, chunk_size=B,
                chunk_indices=call.chunk_indices, chunk_offsets=call.chunk_offsets,
            )
        dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
            q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk, h=h, do=do, dh=_along_t(dhs), dv=_along_t(dvs),
            scale=scale,
            chunk_size=B, chunk_offsets=rnd.chunk_offsets, **packed,
        )
        dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                             dg=dg, chunk_size=B, **packed)
        H, HV = q.shape[2], v.shape[2]
        if HV > H:
            dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
            dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
        dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, **packed)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0, None, None


def fla_kda_round(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rnd,
                  initial_state: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`LinearAttention.core_round` on fla's kernels: the round's rows q, k `[T, H, K]`, v `[T, HV, V]`,
    g `[T, HV, K]`, beta `[T, HV]` (as `models.linear_attention.CoreInputs`), initial_state `[N_0, HV, K, V]` fp32
    or None (zeros); returns (o `[T, HV, V]` in v's dtype, the final state of every piece `[P, HV, K, V]` fp32)."""
    if chunk_size != rnd.chunk_size:
        raise ValueError(f"the layout's rounds are planned for chunk size {rnd.chunk_size}, the mixer runs {chunk_size}")
    q, k, v_, g, beta = (t[None].contiguous() for t in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, finals = _KDARound.apply(q, k, v_, g, beta, h0, rnd, q.shape[-1] ** -0.5)
    return o[0].to(v.dtype), finals
