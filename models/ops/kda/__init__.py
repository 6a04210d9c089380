"""Kimi Delta Attention core: `kda_core` runs `chunk_kda` (fla) on CUDA and `naive_chunk_kda` otherwise."""

from models.ops.dispatch import use_fla
from models.ops.kda.chunk import chunk_kda
from models.ops.kda.naive import naive_chunk_kda


def kda_core(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_size=64,
):
    """Signature and returns of `models.ops.kda.naive.naive_chunk_kda`."""
    op = chunk_kda if use_fla(v) else naive_chunk_kda
    return op(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size)


__all__ = ["chunk_kda", "kda_core", "naive_chunk_kda"]
