"""fla fast path for the KDA core (CUDA): `fla.ops.kda.chunk_kda` with the plain delta-rule flags, plus boundary states.

Legend: B batch rows, T tokens, N sequences, H query/key heads, HV value heads, K/V key/value head dims,
R requested states.
Reference with the same signature: `models.ops.kda.naive.naive_chunk_kda`.
"""

import torch

from models.ops.delta_rule.rounds import chunk_delta_rule_in_rounds

FLA_KDA_CHUNK_SIZES = (32, 64)


def fla_kda_kernel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size):
    """One `fla.ops.kda.chunk_kda` call (imported here: importing fla.ops takes seconds). Gates and beta arrive
    activated and q/k normalised, so every in-kernel activation flag stays off; states are K-first `[N, HV, K, V]`."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        state_v_first=False,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=chunk_size,
    )


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    state_seq: torch.Tensor | None = None,
    state_chunk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """KDA core on fla's Triton kernels; arguments and returns as `naive_chunk_kda` (chunk_size 32 or 64, K <= 256).

    Requested boundary states come from `models.ops.delta_rule.rounds` (one kernel call per piece depth, fp32 states,
    gradients through fla's own dh0/dht). Without requests it is one `chunk_kda` call.
    """
    if chunk_size not in FLA_KDA_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be one of {FLA_KDA_CHUNK_SIZES} on the fla KDA path, got {chunk_size!r}")
    if q.dim() == 4 and q.shape[-1] > 256:
        raise ValueError(f"the fla KDA path needs head dim K <= 256, got K={q.shape[-1]}")
    return chunk_delta_rule_in_rounds(
        fla_kda_kernel,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        chunk_size,
        state_seq,
        state_chunk,
        per_channel_gate=True,
    )
