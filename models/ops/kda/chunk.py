"""fla fast path for the KDA core (CUDA): `fla.ops.kda.chunk_kda` with the plain delta-rule flags.

Legend: B batch rows, T tokens, N sequences, H query/key heads, HV value heads, K/V key/value head dims.
Reference with the same signature: `models.ops.kda.naive.naive_chunk_kda`.
"""

import torch

from models.ops.delta_rule.fla_args import fla_delta_rule_kwargs
from models.recompute import in_recomputed_part

FLA_KDA_CHUNK_SIZES = (32, 64)
FLA_KDA_MAX_HEAD_DIM = 256


def check_fla_kda_limits(chunk_size: int, head_dim: int) -> None:
    """fla's KDA kernels take chunk sizes 32 and 64 and head dims K up to 256 (the plain path and the round path)."""
    if chunk_size not in FLA_KDA_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be one of {FLA_KDA_CHUNK_SIZES} on the fla KDA path, got {chunk_size!r}")
    if head_dim > FLA_KDA_MAX_HEAD_DIM:
        raise ValueError(f"the fla KDA path needs head dim K <= {FLA_KDA_MAX_HEAD_DIM}, got K={head_dim}")


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
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA core on fla's Triton kernels; arguments and returns as `naive_chunk_kda` (chunk_size 32 or 64, K <= 256).

    Gates and beta arrive activated and q/k normalised, so every in-kernel activation flag stays off; states are
    K-first `[N, HV, K, V]` fp32 (`models.ops.delta_rule.fla_args`). In a layer that backward recomputes
    (`models.recompute.in_recomputed_part`) fla saves the WY factors, chunk states and new values it computes
    (`disable_recompute`: about 7 `[T, HV, K]`-sized bf16 tensors, kept only from this layer's recomputation to its
    backward), so its backward does not run `recompute_w_u_fwd` and the state recurrence again. fla is imported
    here (a slow import).
    """
    check_fla_kda_limits(chunk_size, q.shape[-1] if q.dim() == 4 else 0)
    kwargs = fla_delta_rule_kwargs(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size,
        per_channel_gate=True,
    )
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    o, final_state = fla_chunk_kda(q, k, v, g, beta, use_gate_in_kernel=False,
                                   disable_recompute=in_recomputed_part(), **kwargs)
    return o.to(v.dtype), final_state
