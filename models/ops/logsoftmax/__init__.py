"""Vocabulary passes of the log-probabilities: `exp_sums` and `logit_grads` run the Triton kernels (`fused.py`) on
CUDA fp32 logits when `fused` (a model's `KernelSettings.fused_rowwise`), and the references otherwise (float64 models
among them)."""

from models.ops.dispatch import use_fused_rowwise
from models.ops.logsoftmax.naive import naive_exp_sums, naive_logit_grads


def exp_sums(logits_RV, max_R, with_entropy, *, fused=True):
    """Signature and returns of `models.ops.logsoftmax.naive.naive_exp_sums`; `fused`: the kernel where it can run."""
    if use_fused_rowwise(logits_RV, fused):
        from models.ops.logsoftmax.fused import fused_exp_sums

        return fused_exp_sums(logits_RV, max_R, with_entropy)
    return naive_exp_sums(logits_RV, max_R, with_entropy)


def logit_grads(logits_RV, lse_R, g_R, rows_P, targets_P, values_P, ge_R, ent_R, dtype, out=None, *, fused=True):
    """Signature and returns of `models.ops.logsoftmax.naive.naive_logit_grads`; `fused`: the kernel where it can
    run."""
    if use_fused_rowwise(logits_RV, fused):
        from models.ops.logsoftmax.fused import fused_logit_grads

        return fused_logit_grads(logits_RV, lse_R, g_R, rows_P, targets_P, values_P, ge_R, ent_R, dtype, out)
    return naive_logit_grads(logits_RV, lse_R, g_R, rows_P, targets_P, values_P, ge_R, ent_R, dtype, out)


__all__ = ["exp_sums", "logit_grads", "naive_exp_sums", "naive_logit_grads"]
