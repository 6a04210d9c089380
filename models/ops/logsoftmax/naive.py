"""Plain-torch passes over one chunk of vocabulary logits, as `models.logprobs` runs them: the log-sum-exp's sums
forward, the logits' gradient backward.

Legend: R rows of the chunk, V vocabulary (or this shard's part of it), P predictions read from the chunk's rows.
"""

import torch


def naive_exp_sums(logits_RV: torch.Tensor, max_R: torch.Tensor, with_entropy: bool) -> torch.Tensor:
    """Per row, with x = logits - max: sum(exp(x)) and, `with_entropy`, sum(exp(x) x).

    Args:
        logits_RV: `[R, V]` fp32 (float64 for float64 models) logits.
        max_R: `[R]` the maximum each row's sums shift by (over every vocabulary shard).
    Returns: `[1, R]`, or `[2, R]` with the entropy sum second, in the logits' dtype.
    """
    shifted_RV = logits_RV - max_R[:, None]
    exp_RV = shifted_RV.exp()
    if with_entropy:
        return torch.stack([exp_RV.sum(-1), exp_RV.mul_(shifted_RV).sum(-1)])
    return exp_RV.sum(-1)[None]


def naive_logit_grads(
    logits_RV: torch.Tensor, lse_R: torch.Tensor, g_R: torch.Tensor, rows_P: torch.Tensor, targets_P: torch.Tensor,
    values_P: torch.Tensor, ge_R: torch.Tensor | None, ent_R: torch.Tensor | None, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the chunk's logits: with logp = logits - lse and p = exp(logp),
    d = -g p - ge p (logp + ent) (the entropy term only with `ge_R`), plus `values_P[j]` at (rows_P[j],
    targets_P[j]) for every prediction j (summed where pairs repeat), all in the logits' dtype, rounded once.

    Args:
        logits_RV: `[R, V]` fp32 (float64) logits. lse_R: `[R]` their log-sum-exp (over every shard).
        g_R: `[R]` the sum of the incoming log-prob gradients of each row's predictions.
        rows_P: `[P]` int64 chunk rows of the predictions, ascending. targets_P: `[P]` int64 columns.
        values_P: `[P]` the one-hot part of each prediction's gradient (its incoming gradient; 0 where this shard
            does not hold the target).
        ge_R, ent_R: `[R]` the sum of incoming entropy gradients and the entropies, or both None.
        dtype: the dtype of the result (the hidden states').
        out: `[R, V]` contiguous in `dtype` to write the result into, or None (a new tensor).
    Returns: `[R, V]` in `dtype` (`out` when given).
    """
    logp_RV = logits_RV - lse_R[:, None]
    p_RV = logp_RV.exp()
    d_RV = p_RV * (-g_R[:, None])
    if ge_R is not None:
        d_RV -= ge_R[:, None] * p_RV * (logp_RV + ent_R[:, None])
    d_RV.index_put_((rows_P, targets_P), values_P, accumulate=True)
    return d_RV.to(dtype) if out is None else out.copy_(d_RV)
