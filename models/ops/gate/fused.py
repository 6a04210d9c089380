"""fla fast path for the KDA decay gate (CUDA): `fla.ops.kda.gate.fused_kda_gate`.

Reference with the same signature: `models.ops.gate.naive.naive_kda_decay`. The kernel is elementwise per
(row, head) block (A_log and dt_bias broadcast), so a row's gate does not depend on the other rows; it computes in
fp32 and stores fp32, as the reference (softplus by fla's formula: the last bits can differ). Backward: dA_log and
dt_bias are sums over rows (partials per 32-row block). fla is imported here (slow import).
"""

import torch


def fused_kda_decay(f_THK: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """As `naive_kda_decay` (fp32 output)."""
    from fla.ops.kda.gate import fused_kda_gate

    T, H, K = f_THK.shape
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(
            f"`A_log` must have H={H} and `dt_bias` H K={H * K} elements, got {A_log.numel()} and {dt_bias.numel()}"
        )
    return fused_kda_gate(f_THK, A_log, dt_bias, output_dtype=torch.float32)
