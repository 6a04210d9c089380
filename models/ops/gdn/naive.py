"""Plain-torch reference for Gated DeltaNet (GDN): per-head scalar gated delta rule, chunkwise, packed.

Legend: B batch rows, T tokens, N sequences, H query/key heads, HV value heads, K/V key/value head dims.
"""

import torch

from models.ops.delta_rule.naive import naive_chunk_delta_rule


def naive_chunk_gdn(
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
    """GDN core: as `models.ops.kda.naive.naive_chunk_kda` but with one log decay per value head and token,
    g `[B, T, HV]`. Matches `fla.ops.gated_delta_rule.naive_recurrent_gated_delta_rule` mathematically
    (which takes `beta` before `g`).

    Returns (o `[B, T, HV, V]` in v.dtype, final_state `[N, HV, K, V]` fp32 or None).
    """
    return naive_chunk_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        cu_seqlens_cpu,
        chunk_size,
        per_channel_gate=False,
    )
