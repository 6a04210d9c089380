"""Plain-torch chunkwise gated delta rule with per-sequence states: the reference behind KDA and GDN.

Legend: N sequences, T tokens, L rows of one chunk (<= chunk_size), H query/key heads, HV value heads,
K/V key/value head dims.

Recurrence per value head (q pre-scaled, G = HV / H query/key heads shared by each group of value heads):
    S_t = diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = S_t^T q_t
with g_t per channel `[K]` (KDA) or one scalar per head (GDN, broadcast over K).

Exactness contract (what tree execution with replay relies on): a chunk is processed by `delta_rule_chunk`, whose
result depends only on that chunk's rows and its incoming state, computed on fresh contiguous `[HV, L, ...]` copies
with shapes that depend only on L. The same rows with the same incoming state therefore give bitwise identical
outputs and outgoing state in whatever call, sequence or batch they appear. Chunks are never batched across
sequences, which would make the float ops depend on the batch.
"""

import torch

from models.ops.delta_rule.partition import check_delta_rule_shapes, make_partition


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs are computed in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def delta_rule_chunk(
    q_HLK: torch.Tensor,
    k_HLK: torch.Tensor,
    v_HLV: torch.Tensor,
    g_HL: torch.Tensor,
    beta_HL: torch.Tensor,
    state_HKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the gated delta rule. g_HL is `[HV, L, K]` (per-channel decay) or `[HV, L]` (per-head decay).

    All inputs are in the compute dtype; q is already scaled.
    Returns (o `[HV, L, V]`, state after the chunk `[HV, K, V]`).
    """
    L = q_HLK.shape[1]
    # Inclusive log-decay from the chunk start to each row: gc[t] = g[0] + ... + g[t].
    gc = g_HL.cumsum(1)
    future = torch.ones(L, L, dtype=torch.bool, device=q_HLK.device).triu(1)
    if gc.dim() == 3:
        # exp(gc[t] - gc[i]) for i <= t, per channel; masked before exp so that i > t cannot overflow.
        decay_HLLK = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill(future[:, :, None], float("-inf")).exp()
        # decayed_k[h, t, i] = k_i * exp(gc[t] - gc[i]); kk[h, t, i] = k_t . decayed_k[h, t, i] (same for q).
        decayed_k_HLLK = decay_HLLK * k_HLK[:, None, :, :]
        kk_HLL = (k_HLK[:, :, None, :] * decayed_k_HLLK).sum(-1)
        qk_HLL = (q_HLK[:, :, None, :] * decayed_k_HLLK).sum(-1)
        decay_from_start = gc.exp()  # [HV, L, K]
        decay_to_end = (gc[:, -1:, :] - gc).exp()  # [HV, L, K]
        decay_chunk = gc[:, -1, :, None].exp()  # [HV, K, 1]
    else:
        decay_HLL = (gc[:, :, None] - gc[:, None, :]).masked_fill(future, float("-inf")).exp()
        kk_HLL = (k_HLK @ k_HLK.transpose(1, 2)) * decay_HLL
        qk_HLL = (q_HLK @ k_HLK.transpose(1, 2)) * decay_HLL
        decay_from_start = gc.exp()[..., None]  # [HV, L, 1]
        decay_to_end = (gc[:, -1:] - gc).exp()[..., None]  # [HV, L, 1]
        decay_chunk = gc[:, -1, None, None].exp()  # [HV, 1, 1]
    # Delta-rule corrections u within the chunk solve (I + tril(beta kk^T, -1)) u = beta (v - (k exp(gc)) S):
    # split into u = new_v - w S with one unit-lower-triangular solve for both right-hand sides.
    system_HLL = (beta_HL[:, :, None] * kk_HLL).tril(-1)
    rhs = beta_HL[:, :, None] * torch.cat([v_HLV, k_HLK * decay_from_start], dim=-1)
    solved = torch.linalg.solve_triangular(system_HLL, rhs, upper=False, unitriangular=True)
    new_v_HLV, w_HLK = solved.split([v_HLV.shape[-1], k_HLK.shape[-1]], dim=-1)
    u_HLV = new_v_HLV - w_HLK @ state_HKV
    o_HLV = (q_HLK * decay_from_start) @ state_HKV + qk_HLL.tril() @ u_HLV
    state_out = state_HKV * decay_chunk + (k_HLK * decay_to_end).transpose(1, 2) @ u_HLV
    return o_HLV, state_out


def _chunk_rows(x_TX: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a `[T, HV, ...]` tensor as a fresh contiguous `[HV, L, ...]` tensor."""
    return x_TX[start:end].transpose(0, 1).contiguous()


def naive_chunk_delta_rule(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared body of `naive_chunk_kda` (per_channel_gate=True) and `naive_chunk_gdn`; see those for the arguments."""
    B, T, H, K = q.shape
    partition = make_partition(B, T, cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, chunk_size)
    check_delta_rule_shapes(q, k, v, g, beta, initial_state, partition.num_seqs, per_channel_gate)
    HV, V = v.shape[2], v.shape[3]
    dtype = compute_dtype(q, k, v, g, beta)
    if scale is None:
        scale = K**-0.5

    # Row-local preprocessing (elementwise, so it cannot couple chunks): GVA expansion, query scale, upcast.
    q_all = q.to(dtype).repeat_interleave(HV // H, dim=2) * scale  # [B, T, HV, K]
    k_all = k.to(dtype).repeat_interleave(HV // H, dim=2)  # [B, T, HV, K]
    v_all, g_all, beta_all = v.to(dtype), g.to(dtype), beta.to(dtype)

    o_rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
    states: list[torch.Tensor] = []
    for i in range(partition.num_seqs):
        b = partition.batch_row[i]
        if initial_state is None:
            state = q_all.new_zeros(HV, K, V)
        else:
            state = initial_state[i].to(dtype)
        for c in range(partition.num_chunks(i)):
            start, end = partition.chunk_bounds(i, c)
            o_HLV, state = delta_rule_chunk(
                *(_chunk_rows(x[b], start, end) for x in (q_all, k_all, v_all, g_all, beta_all)), state
            )
            o_rows[b].append(o_HLV.transpose(0, 1))
        states.append(state)

    o = torch.stack([torch.cat(rows, dim=0) if rows else v_all.new_zeros(0, HV, V) for rows in o_rows]).to(v.dtype)
    final_state = torch.stack(states) if output_final_state else None
    return o, final_state
