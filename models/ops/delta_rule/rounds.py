"""Boundary states on top of a fused chunk kernel that only returns final states ("split at export, chain by rounds").

Legend: B batch rows, T tokens, N sequences, HV value heads, K/V key/value head dims, R requested states.

fla's chunk kernels return per-sequence final states with autograd but no intermediate states with autograd. The
requested states are chunk-aligned, so cutting every sequence at its requested chunk starts leaves the chunk list
unchanged: piece j of a sequence covers whole chunks of it. Round r runs one packed kernel call over piece r of every
sequence that has one, with initial_state = the final state of that sequence's piece r-1 from round r-1. The state
at a cut is then an fp32 final state returned by the kernel, and autograd chains rounds through the kernel's own
`dh0`/`dht` support: no kernel change, exact gradients. Cost: 1 + (most cuts in one sequence) calls instead of one.
Without requests this is exactly one kernel call.

Why not one call: a piece's initial state is produced by the previous piece, so pieces of one sequence cannot
share a call without a kernel-side prescan (fla.md section 7.2 / 8.3, the planned upgrade).
"""

from collections.abc import Callable

import torch

from models.ops.delta_rule.naive import compute_dtype
from models.ops.delta_rule.partition import check_delta_rule_shapes, check_state_requests, make_partition

ChunkKernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""kernel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size)
-> (o `[1 or B, T, HV, V]`, final_state `[N, HV, K, V]` fp32 or None), fla's chunk op with its plain-rule flags."""


def chunk_delta_rule_in_rounds(
    kernel: ChunkKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    state_seq: torch.Tensor | None,
    state_chunk: torch.Tensor | None,
    per_channel_gate: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Shared body of the fla paths `chunk_kda` / `chunk_gdn`: the same contract as their naive references."""
    B, T = q.shape[:2]
    if state_seq is None and state_chunk is None:
        num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1 (pack sequences along T), got B={B}")
        check_delta_rule_shapes(q, k, v, g, beta, initial_state, num_seqs, per_channel_gate)
        o, final_state = kernel(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, None, chunk_size
        )
        return o.to(v.dtype), final_state, None

    partition = make_partition(B, T, cu_seqlens, chunk_size)
    check_delta_rule_shapes(q, k, v, g, beta, initial_state, partition.num_seqs, per_channel_gate)
    requests = check_state_requests(partition, state_seq, state_chunk)
    device = q.device
    # Flatten batch rows into one packed row so that every round is a varlen call.
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    offsets = [partition.batch_row[i] * T for i in range(partition.num_seqs)]

    # Cuts: requested chunk starts strictly inside a sequence. pieces[i][j] = flat token range of piece j.
    cuts = [
        sorted({c for s, c in requests if s == i and 0 < c < partition.num_chunks(i)})
        for i in range(partition.num_seqs)
    ]
    pieces = []
    for i in range(partition.num_seqs):
        edges = [partition.bos[i]] + [partition.bos[i] + c * chunk_size for c in cuts[i]] + [partition.eos[i]]
        pieces.append([(offsets[i] + a, offsets[i] + b) for a, b in zip(edges, edges[1:])])

    zeros = q.new_zeros(v.shape[2], k.shape[3], v.shape[3], dtype=compute_dtype(q, k, v, g, beta))
    state_in = [None if initial_state is None else initial_state[i].to(zeros.dtype) for i in range(partition.num_seqs)]
    # states_at[i][c] = state of sequence i at the start of its chunk c, filled as the rounds produce them.
    states_at = [{0: zeros if s is None else s} for s in state_in]
    o_parts, rows_parts = [], []
    for r in range(max(len(p) for p in pieces)):
        seqs = [i for i in range(partition.num_seqs) if len(pieces[i]) > r]
        rows = torch.cat([torch.arange(*pieces[i][r], device=device) for i in seqs])
        lengths = [pieces[i][r][1] - pieces[i][r][0] for i in seqs]
        cu_cpu = torch.tensor([0] + lengths).cumsum(0)
        h0 = None if r == 0 and initial_state is None else torch.stack([state_in[i] for i in seqs])
        o_r, final_r = kernel(
            *(x.index_select(1, rows) for x in flat), scale, h0, True, cu_cpu.to(device), cu_cpu, chunk_size
        )
        o_parts.append(o_r[0])
        rows_parts.append(rows)
        for n, i in enumerate(seqs):
            state_in[i] = final_r[n]
            chunk = partition.num_chunks(i) if r == len(pieces[i]) - 1 else cuts[i][r]
            states_at[i][chunk] = final_r[n]

    rows_all = torch.cat(rows_parts)
    inverse = torch.empty_like(rows_all)
    inverse[rows_all] = torch.arange(rows_all.numel(), device=device)
    o = torch.cat(o_parts).index_select(0, inverse).reshape(B, T, *v.shape[2:]).to(v.dtype)
    final_state = None
    if output_final_state:
        final_state = torch.stack([states_at[i][partition.num_chunks(i)] for i in range(partition.num_seqs)])
    boundary_states = torch.stack([states_at[i][c] for i, c in requests])
    return o, final_state, boundary_states
