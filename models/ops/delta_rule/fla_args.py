"""The arguments our fla fast paths (`models.ops.kda.chunk`, `models.ops.gdn.chunk`) pass to fla's chunk ops."""

import numpy as np
import torch

from models.ops.delta_rule.partition import check_delta_rule_shapes


def fla_delta_rule_kwargs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    chunk_size: int,
    per_channel_gate: bool,
) -> dict:
    """Check a call with no host synchronisation (shapes, not offsets) and return fla's keyword arguments: gates and
    beta arrive activated and q/k normalised, so every in-kernel activation stays off; K-first fp32 states."""
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (pack sequences along T), got B={q.shape[0]}")
    if cu_seqlens_cpu is not None and (cu_seqlens is None or cu_seqlens_cpu.shape != cu_seqlens.shape):
        raise ValueError("`cu_seqlens_cpu` must be the host copy of `cu_seqlens` (same shape [N+1])")
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_delta_rule_shapes(q, k, v, g, beta, initial_state, num_seqs, per_channel_gate)
    return dict(
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        state_v_first=False,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=chunk_size,
    )


def fla_chunk_arrays(cu_seqlens: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """fla's varlen chunk bookkeeping computed on the host, so a kernel call needs no host synchronisation:
    `prepare_chunk_indices` `[NT, 2]` (sequence, chunk within it) and `prepare_chunk_offsets` `[N+1]` (each
    sequence's first chunk), both int64 like the `cu_seqlens` [N+1] they come from."""
    counts = -(-np.diff(np.asarray(cu_seqlens, dtype=np.int64)) // chunk_size)
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    seq = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    return np.stack([seq, np.arange(seq.size, dtype=np.int64) - first[seq]], axis=1), first
