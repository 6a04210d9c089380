"""Fused vocabulary passes of the log-probabilities (CUDA): one Triton read of a chunk's fp32 logits forward (the
log-sum-exp's sums) and one backward (the logits' gradient, written in the hidden states' dtype) (`kernels.py`).

Legend: R rows, V vocabulary columns, P predictions, NSPLIT column ranges per row.
References with the same signatures: `models.ops.logsoftmax.naive`.

The references' subtract, exp, multiply and sum passes (forward: five reads or writes of `[R, V]` fp32; backward:
eight, then a cast) become one read forward and one read and one bf16 write backward; the one-hot part of each
prediction's gradient is added in fp32 before the single rounding, as the reference's accumulating `index_put_`.
Same fp32 formulas; they differ from the references by the order of the sums and by Triton's exp.
"""

import torch
import triton

from models.ops.logsoftmax import kernels


def _check_unit_column_stride(logits_RV: torch.Tensor) -> None:
    """The kernels read each row's columns contiguously."""
    if logits_RV.stride(1) != 1 and logits_RV.shape[1] > 1:
        raise ValueError(f"`logits_RV` needs unit column stride, got strides {logits_RV.stride()}")


@torch.compiler.disable
def fused_exp_sums(logits_RV: torch.Tensor, max_R: torch.Tensor, with_entropy: bool) -> torch.Tensor:
    """As `naive_exp_sums` (fp32 logits with unit column stride on CUDA)."""
    R, V = logits_RV.shape
    _check_unit_column_stride(logits_RV)
    n = 2 if with_entropy else 1
    partial = torch.empty(n, R, kernels.NSPLIT, dtype=torch.float32, device=logits_RV.device)
    split_cols = triton.cdiv(triton.cdiv(V, kernels.NSPLIT), kernels.BV) * kernels.BV
    if R:
        kernels.exp_sums_fwd_kernel[(R, kernels.NSPLIT)](
            logits_RV, max_R.contiguous(), partial, logits_RV.stride(0), R, V, split_cols, NSPLIT=kernels.NSPLIT,
            BV=kernels.BV, ENTROPY=with_entropy, num_warps=kernels.NUM_WARPS,
        )
    return partial.sum(-1)


@torch.compiler.disable
def fused_logit_grads(
    logits_RV: torch.Tensor, lse_R: torch.Tensor, g_R: torch.Tensor, rows_P: torch.Tensor, targets_P: torch.Tensor,
    values_P: torch.Tensor, ge_R: torch.Tensor | None, ent_R: torch.Tensor | None, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `naive_logit_grads` (fp32 logits with unit column stride on CUDA; `rows_P` ascending)."""
    R, V = logits_RV.shape
    _check_unit_column_stride(logits_RV)
    if out is not None and (out.shape != (R, V) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"`out` must be a contiguous [{R}, {V}] {dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    d_RV = torch.empty(R, V, dtype=dtype, device=logits_RV.device) if out is None else out
    # Row r's predictions are ptr[r]:ptr[r + 1] (rows_P ascending): no host synchronisation.
    ptr = torch.searchsorted(rows_P, torch.arange(R + 1, device=rows_P.device))
    entropy = ge_R is not None
    if R:
        kernels.logit_grads_bwd_kernel[(R, triton.cdiv(V, kernels.BV))](
            logits_RV, lse_R.contiguous(), g_R.contiguous(), ptr, targets_P.contiguous(),
            values_P.to(torch.float32).contiguous(), ge_R.contiguous() if entropy else g_R,
            ent_R.contiguous() if entropy else g_R, d_RV, logits_RV.stride(0), V, BV=kernels.BV, ENTROPY=entropy,
            num_warps=kernels.NUM_WARPS,
        )
    return d_RV
