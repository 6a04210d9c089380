"""Plain-torch KDA decay gate: per-channel log-space decay from the forget-gate projection.

Legend: T rows, H heads, K head dim.
"""

import torch
import torch.nn.functional as F

from models.dtypes import upcast


def naive_kda_decay(f_THK: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log_h) * softplus(f + dt_bias), in fp32 (float64 for float64 inputs).

    Args:
        f_THK: `[T, H, K]` forget-gate projection (model dtype). A_log: H elements (`[1, 1, H, 1]` as stored).
        dt_bias: `[H K]`.
    Returns: `[T, H, K]` in the upcast dtype (fp32 / float64), transformers' `KimiLinearDeltaAttention` order.
    """
    T, H, K = f_THK.shape
    dtype = upcast(f_THK.dtype)
    f = (f_THK.reshape(T, H * K).to(dtype) + dt_bias.to(dtype)).view(T, H, K)
    return -A_log.to(dtype).exp().view(H, 1) * F.softplus(f)
