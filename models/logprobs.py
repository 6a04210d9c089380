"""Compact-to-semantic log-probabilities (HARTS §3.5), on a whole or a vocabulary-sharded LM head.

Legend: C compact rows, D model dim, V vocabulary (or this shard's part of it), S semantic positions (original order),
U used rows (rows some position reads), P predicted positions, R rows of one chunk.

A compact row's logits predict the next token of every semantic position mapped to it, and those targets may differ
(at a fork). The vocabulary-wide log-sum-exp is computed once per compact row that some position reads, each target
logit is gathered per semantic position, and the result is returned in original order. Vocabulary-sized tensors exist
only for one chunk of rows at a time: forward keeps just one log-sum-exp per row, and backward recomputes each chunk's
logits, so peak memory is O(chunk_rows x V), never S x V or C x V. Backward sums the contributions of every position
into its shared row: (p - e_y1) + (p - e_y2), not one target's gradient times a count. With bf16/fp16 inputs the
logits and the LM-head gradient are fp32 sums of the exact products, never rounded to the input dtype (on CUDA the
GEMM writes fp32 and accumulates the gradient itself). On CUDA the passes over a chunk's fp32 logits run fused
(`models.ops.logsoftmax`: one read forward for the log-sum-exp's sums, one read and one write of the gradient in the
hidden states' dtype backward) where the caller asks for them (`fused`: a model's `KernelSettings.fused_rowwise`).

With the LM head split by vocabulary (`VocabShards`), each shard computes its [R, V] logits and only per-row scalars
cross shards: the row maximum (max), the sums of exp(logit - max) and, for the entropy, of exp(logit - max) *
(logit - max) (one sum), and per prediction its target logit (sum; zero on shards not holding the target). Backward
needs no reduction: the LM-head gradient of a shard is its rows'; the hidden-state gradient is a sum over shards,
which the caller applies (`parallel.collectives.copy_to_group`).
"""

from __future__ import annotations

import torch

from models.dtypes import mm_upcast, upcast
from models.ops.logsoftmax import exp_sums, logit_grads

__all__ = ["VocabShards", "compact_logprobs", "naive_compact_logprobs", "sharded_compact_logprobs", "whole_chunks"]

#: Bytes of fp32 vocabulary-sized scratch (logits and probabilities of one chunk) when chunk_rows is not given.
CHUNK_BUDGET_BYTES = 512 * 2**20
#: The most rows of one chunk when chunk_rows is not given (small vocabularies: on CUDA every chunk is full, below).
MAX_CHUNK_ROWS = 4096
#: Bytes of logit gradients (in the hidden states' dtype) kept for one accumulation of the LM-head gradient: whole
#: chunks, at least one. The accumulation reads and writes the [V, D] fp32 gradient, so with one chunk's few hundred
#: rows it is bound by memory (profiled: bench/RESULTS.md, "Profiled costs behind design choices").
WEIGHT_GRAD_GROUP_BYTES = 2**30


def whole_chunks(rows_U: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Used rows `[U]` -> `[ceil(U / chunk_rows) * chunk_rows]`: padded with copies of the last one.

    On CUDA a chunk's GEMM and its reductions over the vocabulary pick their kernels and split their sums by the
    chunk's shape, so with a shorter last chunk a row's log-prob could depend on how many rows share its chunk, and
    tree and flat microbatches fill chunks differently (the same reason `models.moe.router_logits` runs one GEMM
    shape). With every chunk full, and each target logit read from its chunk's logits, a row's log-prob does not
    depend on the other rows of the call. No prediction reads a copy, so copies get no gradient.
    """
    short = -rows_U.numel() % chunk_rows
    return torch.cat((rows_U, rows_U[-1:].expand(short))) if short else rows_U


class VocabShards:
    """How the LM head's vocabulary is split over devices, and the reductions across the split.

    This base class is the unsplit LM head: one shard holds the whole vocabulary, every target is local and both
    reductions are the identity (no op runs). `parallel.vocab_parallel.GroupVocabShards` splits the vocabulary into
    equal contiguous shards over a process group.
    """

    def vocab_size(self, shard_rows: int) -> int:
        """Size of the whole vocabulary, given the `shard_rows` LM-head rows of this shard."""
        return shard_rows

    def local_targets(self, target_P: torch.Tensor, shard_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global token ids [P] -> their rows in this shard's LM head [P] (some valid row for a target held
        elsewhere), and a bool mask [P] of the targets this shard holds (None: all of them)."""
        return target_P, None

    def max_(self, x: torch.Tensor) -> None:
        """Elementwise maximum of `x` over the shards, in place."""

    def sum_(self, x: torch.Tensor) -> None:
        """Elementwise sum of `x` over the shards, in place."""


def _addmm_(acc_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor) -> None:
    """acc += a @ b in place, with `acc` in the compute dtype (see `models.dtypes.mm_upcast`): on CUDA one cuBLAS call
    with beta = 1, instead of a product in the input dtype, its cast and an add over [M, N] (the LM-head gradient:
    [V, D] per chunk)."""
    if a_MK.dtype == acc_MN.dtype:
        acc_MN.addmm_(a_MK, b_KN)
    elif a_MK.is_cuda and acc_MN.dtype == torch.float32:
        torch.addmm(acc_MN, a_MK, b_KN, out_dtype=acc_MN.dtype, out=acc_MN)
    else:
        acc_MN.addmm_(a_MK.to(acc_MN.dtype), b_KN.to(acc_MN.dtype))


def _validate(hidden_CD, weight_VD, logit_row_S, target_S, vocab_size):
    if hidden_CD.dim() != 2 or weight_VD.dim() != 2 or hidden_CD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"`hidden` must be [C, D] and `weight` [V, D], got {tuple(hidden_CD.shape)} and {tuple(weight_VD.shape)}"
        )
    if logit_row_S.shape != target_S.shape or logit_row_S.dim() != 1:
        raise ValueError(
            f"`logit_row` and `target` must both be [S], got {tuple(logit_row_S.shape)} and {tuple(target_S.shape)}"
        )
    if logit_row_S.numel() and int(logit_row_S.max()) >= hidden_CD.shape[0]:
        raise ValueError(f"`logit_row` holds row {int(logit_row_S.max())} but `hidden` has {hidden_CD.shape[0]} rows")
    valid = logit_row_S >= 0
    if valid.any():
        t = target_S[valid]
        if int(t.min()) < 0 or int(t.max()) >= vocab_size:
            raise ValueError(
                f"`target` ids must lie in [0, {vocab_size}) (vocabulary size), "
                f"got range [{int(t.min())}, {int(t.max())}]"
            )


def naive_compact_logprobs(hidden_CD, weight_VD, logit_row_S, target_S, *, chunk_rows=None, entropy=False,
                           fused=True):
    """Reference with the signature of `compact_logprobs`: full [C, V] log-softmax, then a gather (`chunk_rows` and
    `fused` are not read)."""
    _validate(hidden_CD, weight_VD, logit_row_S, target_S, weight_VD.shape[0])
    logp_CV = torch.log_softmax(mm_upcast(hidden_CD, weight_VD.T, upcast(hidden_CD.dtype)), dim=-1)
    valid = logit_row_S >= 0
    rows = logit_row_S.clamp(min=0)
    out = torch.where(valid, logp_CV[rows, target_S.clamp(min=0)], torch.zeros((), dtype=logp_CV.dtype))
    if not entropy:
        return out
    ent_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return out, torch.where(valid, ent_C[rows], torch.zeros((), dtype=ent_C.dtype))


def _predictions_by_chunk(pred_row_P: torch.Tensor, U: int, chunk_rows: int) -> tuple[torch.Tensor, list[int]]:
    """Predictions `[P]` (indices into the U used rows) sorted by row, `[P]`, and the bounds of chunk i's
    predictions in that order, `bounds[i]:bounds[i + 1]` (one searchsorted, one host sync for all chunks)."""
    order = torch.argsort(pred_row_P, stable=True)
    starts = torch.arange(0, U + chunk_rows, chunk_rows, device=pred_row_P.device).clamp(max=U)
    return order, torch.searchsorted(pred_row_P[order], starts).tolist()


class CompactLogprobsFunction(torch.autograd.Function):
    """Chunked log-softmax gather over the used rows `rows_U` with this shard's LM head `weight_VD`. Predictions
    are `pred_row_P` (index into rows_U) with targets `local_target_P` (rows of weight_VD), held by this shard where
    `held_P` (None: all); `shards` reduces per-row and per-prediction scalars over the vocabulary shards; `fused`:
    the vocabulary passes on their fused kernels where they run (`models.ops.logsoftmax`)."""

    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, rows_U, pred_row_P, local_target_P, held_P, chunk_rows, with_entropy,
                shards, fused):
        cdt = upcast(hidden_CD.dtype)
        U = rows_U.numel()
        lse_U = torch.empty(U, dtype=cdt, device=hidden_CD.device)
        ent_U = torch.empty(U, dtype=cdt, device=hidden_CD.device) if with_entropy else None
        tgt_P = torch.empty(pred_row_P.shape, dtype=cdt, device=hidden_CD.device)
        order, bounds = _predictions_by_chunk(pred_row_P, U, chunk_rows)
        for i, a in enumerate(range(0, U, chunk_rows)):
            b = min(a + chunk_rows, U)
            logits_RV = mm_upcast(hidden_CD[rows_U[a:b]], weight_VD.T, cdt)
            # Target logits from the very logits the log-sum-exp sums (one GEMM shape per chunk).
            sel = order[bounds[i] : bounds[i + 1]]
            tgt_P[sel] = logits_RV[pred_row_P[sel] - a, local_target_P[sel]]
            max_R = logits_RV.amax(dim=-1)
            shards.max_(max_R)
            # Entropy = log Z - sum(e (l - max)) / Z: two non-negative terms, no cancellation.
            sums = exp_sums(logits_RV, max_R, with_entropy, fused=fused)
            shards.sum_(sums)
            log_z_R = sums[0].log()
            lse_U[a:b] = max_R + log_z_R
            if with_entropy:
                ent_U[a:b] = log_z_R - sums[1] / sums[0]
        if held_P is not None:
            tgt_P = tgt_P.masked_fill(~held_P, 0)
        shards.sum_(tgt_P)
        ctx.save_for_backward(hidden_CD, weight_VD, rows_U, pred_row_P, local_target_P, held_P, lse_U, ent_U, order)
        ctx.chunk_rows = chunk_rows
        ctx.bounds = bounds
        ctx.with_entropy = with_entropy
        ctx.fused = fused
        logprob_P = tgt_P - lse_U[pred_row_P]
        if with_entropy:
            return logprob_P, ent_U[pred_row_P]
        return logprob_P

    @staticmethod
    def backward(ctx, dlogprob_P, dentropy_P=None):
        hidden_CD, weight_VD, rows_U, pred_row_P, local_target_P, held_P, lse_U, ent_U, order = ctx.saved_tensors
        cdt = lse_U.dtype
        U = rows_U.numel()
        dlogprob_P = dlogprob_P.to(cdt)
        # Sum of incoming gradients per used row: the softmax part of every prediction's gradient.
        g_U = torch.zeros(U, dtype=cdt, device=lse_U.device).index_add_(0, pred_row_P, dlogprob_P)
        ge_U = None
        if ctx.with_entropy and dentropy_P is not None:
            ge_U = torch.zeros(U, dtype=cdt, device=lse_U.device).index_add_(0, pred_row_P, dentropy_P.to(cdt))
        # The one-hot part: only targets this shard holds.
        donehot_P = dlogprob_P if held_P is None else dlogprob_P.masked_fill(~held_P, 0)
        dhidden_CD = torch.zeros_like(hidden_CD) if ctx.needs_input_grad[0] else None
        dweight_VD = None
        if ctx.needs_input_grad[1]:
            dweight_VD = torch.zeros(weight_VD.shape, dtype=cdt, device=weight_VD.device)
        bounds, R = ctx.bounds, ctx.chunk_rows
        # The LM-head gradient sums over the rows of a group of chunks at once (their logit gradients kept side by
        # side in `group_dlogits`): one accumulation of the [V, D] fp32 gradient per group, not per chunk.
        group_rows = R * max(1, WEIGHT_GRAD_GROUP_BYTES // (R * weight_VD.shape[0] * hidden_CD.element_size()))
        group_dlogits = None
        if dweight_VD is not None:
            group_dlogits = hidden_CD.new_empty(min(group_rows, U), weight_VD.shape[0])
        for i, a in enumerate(range(0, U, R)):
            b = min(a + R, U)
            start = a - a % group_rows
            h = hidden_CD[rows_U[a:b]]
            sel = order[bounds[i] : bounds[i + 1]]
            dlogits = logit_grads(
                mm_upcast(h, weight_VD.T, cdt), lse_U[a:b], g_U[a:b], pred_row_P[sel] - a, local_target_P[sel],
                donehot_P[sel], None if ge_U is None else ge_U[a:b], None if ge_U is None else ent_U[a:b],
                hidden_CD.dtype, None if group_dlogits is None else group_dlogits[a - start : b - start],
                fused=ctx.fused,
            )
            if dhidden_CD is not None:
                dhidden_CD.index_add_(0, rows_U[a:b], dlogits @ weight_VD)
            if group_dlogits is not None and (b == U or b - start == group_rows):
                _addmm_(dweight_VD, group_dlogits[: b - start].T, hidden_CD[rows_U[start:b]])
        if dweight_VD is not None:
            dweight_VD = dweight_VD.to(weight_VD.dtype)
        return dhidden_CD, dweight_VD, None, None, None, None, None, None, None, None


def sharded_compact_logprobs(
    hidden_CD, weight_VD, logit_row_S, target_S, shards: VocabShards, *, chunk_rows=None, entropy=False,
    full_chunks=None, fused=True,
):
    """`compact_logprobs` with `weight_VD` this shard's LM-head rows of the split `shards` (targets are global ids;
    the default `chunk_rows` budgets [rows, V] chunks of this shard). Every shard must make the call with the same
    `hidden_CD`, `logit_row_S` and `target_S`; results are identical on all of them, and the gradient of
    `hidden_CD` is this shard's part (the caller sums it over shards). `full_chunks` (bool or None): run every
    chunk with exactly `chunk_rows` rows (`whole_chunks`); None = on CUDA (tests force it on the CPU). `fused` as in
    `compact_logprobs`."""
    V = weight_VD.shape[0]
    _validate(hidden_CD, weight_VD, logit_row_S, target_S, shards.vocab_size(V))
    if chunk_rows is None:
        chunk_rows = max(1, min(CHUNK_BUDGET_BYTES // (2 * 4 * V), MAX_CHUNK_ROWS))
    if chunk_rows < 1:
        raise ValueError(f"`chunk_rows` must be >= 1, got {chunk_rows}")
    cdt = upcast(hidden_CD.dtype)
    valid = logit_row_S >= 0
    rows_U, pred_row_P = torch.unique(logit_row_S[valid], return_inverse=True)
    if hidden_CD.is_cuda if full_chunks is None else full_chunks:
        rows_U = whole_chunks(rows_U, int(chunk_rows))
    local_target_P, held_P = shards.local_targets(target_S[valid], V)
    result = CompactLogprobsFunction.apply(
        hidden_CD, weight_VD, rows_U, pred_row_P, local_target_P, held_P, int(chunk_rows), bool(entropy), shards,
        bool(fused),
    )
    outputs = result if entropy else (result,)
    full = []
    for values in outputs:
        out = torch.zeros(logit_row_S.shape, dtype=cdt, device=hidden_CD.device)
        full.append(out.masked_scatter(valid, values))
    return tuple(full) if entropy else full[0]


_WHOLE_VOCABULARY = VocabShards()


def compact_logprobs(hidden_CD, weight_VD, logit_row_S, target_S, *, chunk_rows=None, entropy=False, fused=True):
    """Per-semantic-position log-probabilities from compact hidden states.

    Args:
        hidden_CD: [C, D] final (normed) hidden states of the compact rows, any float dtype.
        weight_VD: [V, D] LM head weight.
        logit_row_S: [S] int64, the row whose logits predict position s (-1: position predicts nothing, e.g. the first
            token of a trajectory; its output is 0 and carries no gradient).
        target_S: [S] int64, the token id at position s.
        chunk_rows: rows per vocabulary-sized chunk; default keeps the fp32 scratch near 512 MiB (at most 4,096 rows).
            On CUDA every chunk runs with exactly this many rows (`whole_chunks`: a given value sets the scratch
            memory, [chunk_rows, V] fp32), so a row's log-prob does not depend on the other rows of the call.
        entropy: also return the entropy of each position's predictive distribution.
        fused: the vocabulary passes on their fused kernels where they run (`models.ops.logsoftmax`; a model's
            `KernelSettings.fused_rowwise`).
    Returns:
        logprobs [S] (fp32, or fp64 for fp64 inputs), and entropy [S] if requested. Rows that no position reads are
        never multiplied by the LM head.
    Reference: `naive_compact_logprobs` (same signature). Vocabulary-sharded LM head: `sharded_compact_logprobs`.
    """
    return sharded_compact_logprobs(
        hidden_CD, weight_VD, logit_row_S, target_S, _WHOLE_VOCABULARY, chunk_rows=chunk_rows, entropy=entropy,
        fused=fused,
    )
