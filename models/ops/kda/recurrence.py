"""fla's two chunk-state recurrences (forward `chunk_gated_delta_rule_fwd_h`, backward `chunk_gated_delta_rule_bwd_dhu`,
fla 0.6.0 `fla/ops/common/chunk_delta_h.py`) writing their per-chunk outputs into slices of buffers the caller holds.

Legend: T_j a call's rows, NT_j its chunks, N_j its sequences, H query/key heads, HV value heads, K/V head dims.

A tree layer's calls (`models.ops.kda.calls`) run the recurrences call by call and everything else once over all
calls, so the chunk states h `[1, NT, HV, K, V]` and value tensors `[1, T, HV, V]` of all its calls are one tensor
each. fla's wrappers allocate every call's own outputs, which would then be concatenated: on a 65k-row SWE
microbatch of ling-3-tiny h alone is about 0.5 GB per KDA layer, copied in the forward, in recomputation and twice in
backward (h and dh). Here each call's kernel writes its rows and chunks in place, and its final states into the
state table.

The kernels and launch grids are fla's own (the same code the wrappers run, so the same bits). fla's backend dispatch
(`fla.backends`) can route these two functions to another implementation (in fla 0.6.0 the intra-card context
parallel forward when enabled, under inference mode, and Ascend's on NPUs; tilelang's 'common' backend implements
neither); flat
execution's `chunk_kda` then runs that one, so where a backend would take the call the dispatched wrapper runs here
too and its outputs are copied into the slices.
"""

from __future__ import annotations

import torch

__all__ = ["fwd_h_into", "bwd_dhu_into"]


def _default_kernels_run(function_name: str, kwargs: dict) -> bool:
    """Whether fla's dispatch (`fla.backends.BackendRegistry.dispatch`) of the 'common' delta-rule function
    `function_name` would run its default (Triton) implementation for these arguments: no backend that is available
    and enabled implements it and accepts the call, or dispatch is off (FLA_DISABLE_BACKEND_DISPATCH=1)."""
    from fla import backends

    if backends._DISPATCH_DISABLED:
        return True
    for backend in backends._load_operation_registry("common")._get_sorted_backends():
        if (backend.is_available() and backend.is_enabled() and backend.get_implementation(function_name) is not None
                and backend.verify(function_name, **kwargs)[0]):
            return False
    return True


def fwd_h_into(h: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
               gk: torch.Tensor, initial_state: torch.Tensor | None, final_state: torch.Tensor | None,
               cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, chunk_indices: torch.Tensor,
               chunk_offsets: torch.Tensor, chunk_size: int) -> None:
    """`chunk_gated_delta_rule_fwd_h(k, w, u, gk=gk, ...)` of one call (K-first states, new values saved) writing
    its chunk states into h `[1, NT_j, HV, K, V]`, its new values into v_new `[1, T_j, HV, V]` (contiguous slices of
    the layer's buffers, in k's dtype) and, where `final_state` is given, its final states into it
    (`[N_j, HV, K, V]` fp32, contiguous: a slice of the state table)."""
    import triton
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_fwd_h, chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
    )

    kwargs = dict(k=k, w=w, u=u, gk=gk, initial_state=initial_state, output_final_state=final_state is not None,
                  chunk_size=chunk_size, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                  chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    if not _default_kernels_run("chunk_gated_delta_rule_fwd_h", kwargs):
        h_j, v_j, final = chunk_gated_delta_rule_fwd_h(**kwargs)
        h.copy_(h_j)
        v_new.copy_(v_j)
        if final_state is not None:
            final_state.copy_(final)
        return
    _, T, H, K = k.shape
    HV, V, N = u.shape[2], u.shape[-1], cu_seqlens.numel() - 1
    assert h.shape == (1, chunk_indices.shape[0], HV, K, V) and h.is_contiguous() and h.dtype == k.dtype
    assert v_new.shape == u.shape and v_new.is_contiguous() and v_new.dtype == u.dtype
    assert final_state is None or (final_state.shape == (N, HV, K, V) and final_state.is_contiguous()
                                   and final_state.dtype == torch.float32)
    chunk_gated_delta_rule_fwd_kernel_h_blockdim64[lambda meta: (triton.cdiv(V, meta["BV"]) * N * HV,)](
        k=k, v=u, w=w, v_new=v_new, g=None, gk=gk, h=h, h0=initial_state, ht=final_state, cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size, STATE_V_FIRST=False,
    )


def bwd_dhu_into(dh: torch.Tensor, dv2: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                 do: torch.Tensor, dv: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor | None, dht: torch.Tensor,
                 scale: float, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, chunk_offsets: torch.Tensor,
                 chunk_size: int) -> torch.Tensor | None:
    """`chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, gk=gk, ...)` of one call (K-first states) writing its chunk
    state gradients into dh `[1, NT_j, HV, K, V]` (q's dtype) and its value gradients into dv2 `[1, T_j, HV, V]`
    (dv's dtype), contiguous slices of the layer's buffers. Returns the initial-state gradient `[N_j, HV, K, V]`
    fp32, or None when h0 is None."""
    import triton
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64,
    )

    kwargs = dict(q=q, k=k, w=w, do=do, dv=dv, gk=gk, h0=h0, dht=dht, scale=scale, cu_seqlens=cu_seqlens,
                  chunk_size=chunk_size, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    if not _default_kernels_run("chunk_gated_delta_rule_bwd_dhu", kwargs):
        dh_j, dh0, dv2_j = chunk_gated_delta_rule_bwd_dhu(**kwargs)
        dh.copy_(dh_j)
        dv2.copy_(dv2_j)
        return dh0
    _, T, H, K = q.shape
    HV, V, N = do.shape[2], do.shape[-1], cu_seqlens.numel() - 1
    assert dh.shape == (1, chunk_indices.shape[0], HV, K, V) and dh.is_contiguous() and dh.dtype == q.dtype
    assert dv2.shape == dv.shape and dv2.is_contiguous() and dv2.dtype == dv.dtype
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[lambda meta: (triton.cdiv(V, meta["BV"]) * N * HV,)](
        q=q, k=k, w=w, g=None, gk=gk, dht=dht, dh0=dh0, do=do, dh=dh, dv=dv, dv2=dv2, cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size, STATE_V_FIRST=False,
    )
    return dh0
