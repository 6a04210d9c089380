"""Plain-torch reference for Kimi Delta Attention (KDA): per-channel gated delta rule, chunkwise, packed.

Legend: B batch rows, T tokens, N sequences, H query/key heads, HV value heads, K/V key/value head dims.
"""

import torch

from models.ops.delta_rule.naive import naive_chunk_delta_rule


def naive_chunk_kda(
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
    """KDA core: the delta-rule recurrence only (gates, beta and q/k normalisation are the caller's).

    Args:
        q, k: `[B, T, H, K]` queries and keys (L2-normalised by the caller if wanted).
        v: `[B, T, HV, V]` values, HV a multiple of H (value head j uses query/key head j // (HV // H)).
        g: `[B, T, HV, K]` activated per-token, per-channel log decay (<= 0; the state is multiplied by exp(g)).
        beta: `[B, T, HV]` activated write strengths (e.g. sigmoid of a projection).
        scale: query scale, default `K ** -0.5`.
        initial_state: `[N, HV, K, V]` state per sequence (any float dtype, differentiable); None = zeros.
        output_final_state: return the state after each sequence.
        cu_seqlens: LongTensor `[N+1]` packing N sequences along T (B must be 1); None = each batch row is a sequence.
        cu_seqlens_cpu: the same offsets on the host, optional (spares a device-to-host copy).
        chunk_size: chunk length B; chunk c of sequence i is tokens `[bos_i + c*B, min(bos_i + (c+1)*B, eos_i))`.

    Returns:
        o: `[B, T, HV, V]` in v.dtype.
        final_state: `[N, HV, K, V]` fp32 (float64 for float64 inputs), or None.

    Computed in fp32 (float64 for float64 inputs), chunk by chunk; see `models.ops.delta_rule.naive` for the
    exactness contract. Matches `fla.ops.kda.naive.naive_recurrent_kda` / `naive_chunk_kda` mathematically.
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
        per_channel_gate=True,
    )
