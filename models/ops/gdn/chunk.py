"""fla fast path for the GDN core (CUDA): `fla.ops.gated_delta_rule.chunk_gated_delta_rule` with the plain
delta-rule flags.

Legend: B batch rows, T tokens, N sequences, H query/key heads, HV value heads, K/V key/value head dims.
Reference with the same signature: `models.ops.gdn.naive.naive_chunk_gdn`.
fla's GDN backward raises on Hopper with triton >= 3.4, < 3.7.1 unless `tilelang` is installed; the rule, with the
reason it gives, is `models.ops.fla_limits.gdn_backward_limit`.
"""

import torch

from models.ops.delta_rule.fla_args import fla_delta_rule_kwargs

FLA_GDN_CHUNK_SIZES = (16, 32, 64)


def chunk_gdn(
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
    """GDN core on fla's Triton kernels; arguments and returns as `naive_chunk_gdn` (chunk_size 16, 32 or 64).

    In-kernel activations off, K-first fp32 states `[N, HV, K, V]` (`models.ops.delta_rule.fla_args`); fla is imported
    here (a slow import).
    """
    if chunk_size not in FLA_GDN_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be one of {FLA_GDN_CHUNK_SIZES} on the fla GDN path, got {chunk_size!r}")
    kwargs = fla_delta_rule_kwargs(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size,
        per_channel_gate=False,
    )
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    return o.to(v.dtype), final_state
