"""The explicit chunk partition of a (packed) delta-rule call, and the checks every delta-rule op shares.

Legend: N packed sequences, T tokens, H query/key heads, HV value heads, K/V key/value head dims.

Sequences come either from a batch (`cu_seqlens is None`: row b of `[B, T, ...]` is sequence b) or from packing
(`cu_seqlens` LongTensor `[N+1]`, B must be 1: sequence i is tokens `[cu_seqlens[i], cu_seqlens[i+1])`).
Chunk c of sequence i is tokens `[bos_i + c*chunk_size, min(bos_i + (c+1)*chunk_size, eos_i))`: chunks restart at every
sequence start and the last chunk of a sequence may be partial. This is fla's partition (`prepare_chunk_indices`).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkPartition:
    """Sequences of one call and their chunk geometry (host-side Python ints)."""

    batch_row: tuple[int, ...]
    """Row of the `[B, T, ...]` inputs holding each sequence."""
    bos: tuple[int, ...]
    """First token of each sequence within its row."""
    eos: tuple[int, ...]
    """One past the last token of each sequence within its row."""
    chunk_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.bos)

    def num_chunks(self, i: int) -> int:
        return -(-(self.eos[i] - self.bos[i]) // self.chunk_size)

    def chunk_bounds(self, i: int, c: int) -> tuple[int, int]:
        """Token range `[start, end)` of chunk c of sequence i within its row."""
        start = self.bos[i] + c * self.chunk_size
        return start, min(start + self.chunk_size, self.eos[i])


def make_partition(batch: int, tokens: int, cu_seqlens: torch.Tensor | None, chunk_size: int) -> ChunkPartition:
    """Validate `cu_seqlens`/`chunk_size` for inputs of shape `[batch, tokens, ...]` and build the partition."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")
    if cu_seqlens is None:
        return ChunkPartition(tuple(range(batch)), (0,) * batch, (tokens,) * batch, chunk_size)
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("`cu_seqlens` must be a 1-D int32/int64 tensor [N+1] of cumulative sequence lengths")
    if batch != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (pack sequences along T), got B={batch}")
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"`cu_seqlens` must be non-decreasing from 0 to T={tokens}, got {bounds}")
    n = len(bounds) - 1
    return ChunkPartition((0,) * n, tuple(bounds[:-1]), tuple(bounds[1:]), chunk_size)


def check_delta_rule_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    num_seqs: int,
    per_channel_gate: bool,
) -> None:
    """Shapes of a delta-rule call: q, k `[B, T, H, K]`, v `[B, T, HV, V]`, beta `[B, T, HV]`,
    g `[B, T, HV, K]` (per-channel, KDA) or `[B, T, HV]` (per-head, GDN), initial_state `[N, HV, K, V]`."""
    if q.dim() != 4:
        raise ValueError(f"`q` must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must have the shape of `q` {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"`v` must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} (`v`) must be a multiple of query/key heads H={H} (`q`, `k`)")
    g_shape = (B, T, HV, K) if per_channel_gate else (B, T, HV)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"`g` must have shape {list(g_shape)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"`beta` must have shape {[B, T, HV]}, got {tuple(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (num_seqs, HV, K, V):
        raise ValueError(
            f"`initial_state` must have shape {[num_seqs, HV, K, V]} (N = sequences), got {tuple(initial_state.shape)}"
        )

