"""Gated DeltaNet core: `gdn_core` runs `chunk_gdn` (fla) on CUDA and `naive_chunk_gdn` otherwise."""

from models.ops.dispatch import use_fla
from models.ops.gdn.chunk import chunk_gdn
from models.ops.gdn.naive import naive_chunk_gdn


def gdn_core(
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
    """Signature and returns of `models.ops.gdn.naive.naive_chunk_gdn`."""
    op = chunk_gdn if use_fla(v) else naive_chunk_gdn
    return op(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size)


__all__ = ["chunk_gdn", "gdn_core", "naive_chunk_gdn"]
