"""Vocabulary-parallel compact log-probabilities: `models.logprobs.compact_logprobs` with an LM head sharded over tp.

Legend: C compact rows, D model dim, V vocabulary, Vl = V / t rows of the LM head on this rank, U used rows (rows some
position reads), P predicted positions, S semantic positions.

Rank r holds the LM-head rows [vocab_start, vocab_start + Vl). Per chunk of used rows it computes its local logits
[rows, Vl] and exchanges only per-row scalars over the tp group: the maximum (all-reduce MAX), the sum of
exp(logit - max) and, for the entropy, the sum of exp(logit - max) * logit (one all-reduce SUM); and per prediction
its target logit (all-reduce SUM; zero on ranks that do not hold the target). Backward needs no communication for
the LM head (each rank's gradient is its rows'); the hidden-state gradient is a sum over ranks, applied by the
caller's f (`copy_to_group`) before this function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.logprobs import CHUNK_BUDGET_BYTES

__all__ = ["vocab_parallel_compact_logprobs"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class VocabParallelLogprobsFunction(torch.autograd.Function):
    """Chunked log-softmax gather over used rows `rows_U` with a vocabulary shard; predictions `pred_row_P` index
    rows_U, `target_P` are global token ids."""

    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, rows_U, pred_row_P, target_P, vocab_start, chunk_rows, with_entropy, group):
        cdt = _compute_dtype(hidden_CD.dtype)
        U, Vl = rows_U.numel(), weight_VD.shape[0]
        lse_U = torch.empty(U, dtype=cdt, device=hidden_CD.device)
        ent_U = torch.empty(U, dtype=cdt, device=hidden_CD.device) if with_entropy else None
        for a in range(0, U, chunk_rows):
            b = min(a + chunk_rows, U)
            logits = (hidden_CD[rows_U[a:b]] @ weight_VD.T).to(cdt)
            m = logits.max(dim=-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = (logits - m[:, None]).exp()
            sums = torch.stack([e.sum(-1), (e * logits).sum(-1)]) if with_entropy else e.sum(-1)[None]
            dist.all_reduce(sums, group=group)
            lse_U[a:b] = m + sums[0].log()
            if with_entropy:
                ent_U[a:b] = lse_U[a:b] - sums[1] / sums[0]
        # Target logits: one dot product per prediction whose target this rank holds, summed over ranks.
        local_target = target_P - vocab_start
        mine = (local_target >= 0) & (local_target < Vl)
        tgt_P = torch.zeros(target_P.shape, dtype=cdt, device=hidden_CD.device)
        sel = mine.nonzero()[:, 0]
        tgt_P[sel] = (hidden_CD[rows_U[pred_row_P[sel]]].to(cdt) * weight_VD[local_target[sel]].to(cdt)).sum(-1)
        dist.all_reduce(tgt_P, group=group)
        ctx.save_for_backward(hidden_CD, weight_VD, rows_U, pred_row_P, local_target, mine, lse_U, ent_U)
        ctx.chunk_rows = chunk_rows
        ctx.with_entropy = with_entropy
        logprob_P = tgt_P - lse_U[pred_row_P]
        if with_entropy:
            return logprob_P, ent_U[pred_row_P]
        return logprob_P

    @staticmethod
    def backward(ctx, dlogprob_P, dentropy_P=None):
        hidden_CD, weight_VD, rows_U, pred_row_P, local_target, mine, lse_U, ent_U = ctx.saved_tensors
        cdt = lse_U.dtype
        U = rows_U.numel()
        dlogprob_P = dlogprob_P.to(cdt)
        g_U = torch.zeros(U, dtype=cdt, device=lse_U.device).index_add_(0, pred_row_P, dlogprob_P)
        ge_U = None
        if ctx.with_entropy and dentropy_P is not None:
            ge_U = torch.zeros(U, dtype=cdt, device=lse_U.device).index_add_(0, pred_row_P, dentropy_P.to(cdt))
        dhidden_CD = torch.zeros_like(hidden_CD) if ctx.needs_input_grad[0] else None
        dweight_VD = None
        if ctx.needs_input_grad[1]:
            dweight_VD = torch.zeros(weight_VD.shape, dtype=cdt, device=weight_VD.device)
        # Only predictions whose target this rank holds add a one-hot term; sorted by row (one searchsorted a chunk).
        held = mine.nonzero()[:, 0]
        order = held[torch.argsort(pred_row_P[held], stable=True)]
        sorted_rows = pred_row_P[order]
        for a in range(0, U, ctx.chunk_rows):
            b = min(a + ctx.chunk_rows, U)
            h = hidden_CD[rows_U[a:b]]
            logp = (h @ weight_VD.T).to(cdt) - lse_U[a:b, None]
            p = logp.exp()
            dlogits = p * (-g_U[a:b, None])
            if ge_U is not None:
                dlogits -= ge_U[a:b, None] * p * (logp + ent_U[a:b, None])
            lo, hi = torch.searchsorted(sorted_rows, torch.tensor([a, b], device=sorted_rows.device)).tolist()
            sel = order[lo:hi]
            dlogits.index_put_((pred_row_P[sel] - a, local_target[sel]), dlogprob_P[sel], accumulate=True)
            dlogits = dlogits.to(hidden_CD.dtype)
            if dhidden_CD is not None:
                dhidden_CD.index_add_(0, rows_U[a:b], dlogits @ weight_VD)
            if dweight_VD is not None:
                dweight_VD += (dlogits.T @ h).to(cdt)
        if dweight_VD is not None:
            dweight_VD = dweight_VD.to(weight_VD.dtype)
        return dhidden_CD, dweight_VD, None, None, None, None, None, None, None


def vocab_parallel_compact_logprobs(
    hidden_CD, weight_VD, logit_row_S, target_S, *, vocab_start, group, chunk_rows=None, entropy=False
):
    """`models.logprobs.compact_logprobs` with the LM head split by vocabulary over `group`.

    Args:
        hidden_CD: [C, D] final hidden states, the same on every rank of `group`; wrap it in
            `parallel.collectives.copy_to_group` first so its gradient is summed over the group.
        weight_VD: [Vl, D] this rank's LM-head rows (vocabulary ids [vocab_start, vocab_start + Vl)).
        logit_row_S, target_S: [S] int64 as in `compact_logprobs` (-1 rows predict nothing; targets are global ids).
        vocab_start: first vocabulary id of this rank's shard.
        group: the tensor-parallel process group.
        chunk_rows: rows per chunk of [rows, Vl] logits; default keeps the fp32 scratch near 512 MiB.
        entropy: also return the entropy of each position's predictive distribution (over the whole vocabulary).
    Returns: logprobs [S] (fp32, or fp64 for fp64 inputs), and entropy [S] if requested; identical on all ranks.
    Reference: `models.logprobs.compact_logprobs` on the gathered LM head.
    """
    Vl = weight_VD.shape[0]
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BUDGET_BYTES // (2 * 4 * Vl))
    if chunk_rows < 1:
        raise ValueError(f"`chunk_rows` must be >= 1, got {chunk_rows}")
    if logit_row_S.shape != target_S.shape or logit_row_S.dim() != 1:
        raise ValueError(
            f"`logit_row` and `target` must both be [S], got {tuple(logit_row_S.shape)} and {tuple(target_S.shape)}"
        )
    cdt = _compute_dtype(hidden_CD.dtype)
    valid = logit_row_S >= 0
    rows_U, pred_row_P = torch.unique(logit_row_S[valid], return_inverse=True)
    result = VocabParallelLogprobsFunction.apply(
        hidden_CD, weight_VD, rows_U, pred_row_P, target_S[valid], int(vocab_start), int(chunk_rows), bool(entropy),
        group,
    )
    outputs = result if entropy else (result,)
    full = []
    for values in outputs:
        out = torch.zeros(logit_row_S.shape, dtype=cdt, device=hidden_CD.device)
        full.append(out.masked_scatter(valid, values))
    return tuple(full) if entropy else full[0]
