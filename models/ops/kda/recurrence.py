"""fla's two chunk-state recurrences (forward `chunk_gated_delta_rule_fwd_h`, backward `chunk_gated_delta_rule_bwd_dhu`,
fla 0.6.0 `fla/ops/common/chunk_delta_h.py`) through fla's backend dispatch, one call at a time, and whether that
dispatch would run fla's own Triton kernels.

Legend: T_j a call's rows, NT_j its chunks, N_j its sequences, H query/key heads, HV value heads, K/V head dims.

A tree layer's calls (`models.ops.kda.tree_calls`) run everything but the recurrences once over all calls. Where fla's
dispatch (`fla.backends`) would run the default Triton kernels with tuned configs, the recurrences run round by round
on the same kernels' chain variant (`models.ops.kda.chains`); otherwise here. fla's dispatch can route these two
functions to another implementation (in fla 0.6.0 the intra-card context parallel forward when enabled, under
inference mode, and Ascend's on NPUs; tilelang's 'common' backend implements neither); flat execution's `chunk_kda`
then runs that one, so there the tree's calls run it too, call by call, and its outputs are copied into the layer's
buffers. Without tuned configs fla autotunes its kernels, and the calls run here so that they get its choice.
"""

from __future__ import annotations

import torch

__all__ = ["default_kernels_run", "fwd_h_kwargs", "bwd_dhu_kwargs", "fwd_h_dispatched", "bwd_dhu_dispatched"]


def default_kernels_run(function_name: str, kwargs: dict) -> bool:
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


def fwd_h_kwargs(k, w, u, gk, initial_state, output_final_state: bool, call, chunk_size: int) -> dict:
    """`chunk_gated_delta_rule_fwd_h`'s arguments for one call (`models.ops.kda.call_arrays.CallArrays`): k `[1, T_j,
    H, K]` (gated keys), w `[1, T_j, HV, K]`, u `[1, T_j, HV, V]`, gk `[1, T_j, HV, K]`, initial_state
    `[N_j, HV, K, V]` fp32 or None. Without chunk offsets, as flat's `chunk_kda` calls it, so that fla's dispatch
    judges both alike (its intra-card context-parallel backend refuses calls that bring chunk offsets)."""
    return dict(k=k, w=w, u=u, gk=gk, initial_state=initial_state, output_final_state=output_final_state,
                chunk_size=chunk_size, cu_seqlens=call.cu_seqlens, cu_seqlens_cpu=call.cu_seqlens_cpu,
                chunk_indices=call.chunk_indices, chunk_offsets=None)


def bwd_dhu_kwargs(q, k, w, do, dv, gk, h0, dht, scale: float, call, chunk_size: int) -> dict:
    """`chunk_gated_delta_rule_bwd_dhu`'s arguments for one call: q, k `[1, T_j, H, K]` (gated), w, gk
    `[1, T_j, HV, K]`, do, dv `[1, T_j, HV, V]`, h0 `[N_j, HV, K, V]` or None, dht `[N_j, HV, K, V]` fp32."""
    return dict(q=q, k=k, w=w, do=do, dv=dv, gk=gk, h0=h0, dht=dht, scale=scale, cu_seqlens=call.cu_seqlens,
                chunk_size=chunk_size, chunk_indices=call.chunk_indices, chunk_offsets=None)


def fwd_h_dispatched(h: torch.Tensor, v_new: torch.Tensor, final_state: torch.Tensor | None, kwargs: dict) -> None:
    """Run `chunk_gated_delta_rule_fwd_h(**kwargs)` of one call through fla's dispatch and copy its chunk states into
    h `[1, NT_j, HV, K, V]`, its new values into v_new `[1, T_j, HV, V]` (slices of the layer's buffers) and, where
    given, its final states into final_state `[N_j, HV, K, V]` fp32 (a slice of the state table)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    h_j, v_j, final = chunk_gated_delta_rule_fwd_h(**kwargs)
    h.copy_(h_j)
    v_new.copy_(v_j)
    if final_state is not None:
        final_state.copy_(final)


def bwd_dhu_dispatched(dh: torch.Tensor, dv2: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """Run `chunk_gated_delta_rule_bwd_dhu(**kwargs)` of one call through fla's dispatch, copy its chunk-state
    gradients into dh `[1, NT_j, HV, K, V]` and its value gradients into dv2 `[1, T_j, HV, V]`; returns the
    initial-state gradient `[N_j, HV, K, V]` fp32, or None when h0 is None."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    dh_j, dh0, dv2_j = chunk_gated_delta_rule_bwd_dhu(**kwargs)
    dh.copy_(dh_j)
    dv2.copy_(dv2_j)
    return dh0
