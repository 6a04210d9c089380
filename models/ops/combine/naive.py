"""Plain-torch MoE combine: each row's k expert outputs, weighted and summed in a fixed order.

Legend: T rows, k experts per row, M = T k routed (row, expert) pairs sorted by expert, D model dim.
"""

import torch

from models.dtypes import upcast


def naive_moe_combine(y_MD: torch.Tensor, slot_Tk: torch.Tensor, weights_Tk: torch.Tensor) -> torch.Tensor:
    """out_t = sum_j w_tj y_{slot_tj}.

    Args:
        y_MD: `[M, D]` expert outputs in expert order. slot_Tk: LongTensor `[T, k]`, the row of y of each (row,
            slot) pair (a permutation of 0..M-1). weights_Tk: `[T, k]` combine weights (fp32).
    Returns: `[T, D]` in y.dtype. Rounding: the weights round to y.dtype and every product to y.dtype (the
        products are taken in y.dtype), then the k products are summed in the upcast dtype and rounded once, so
        bf16 rows are not rounded once per expert (as an atomic scatter-add would) and the result is deterministic.
    """
    T, k = slot_Tk.shape
    y_TkD = y_MD[slot_Tk.reshape(-1)].view(T, k, y_MD.shape[-1]) * weights_Tk.to(y_MD.dtype)[:, :, None]
    return y_TkD.sum(1, dtype=upcast(y_MD.dtype)).to(y_MD.dtype)
