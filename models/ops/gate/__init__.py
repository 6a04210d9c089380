"""KDA decay gate: `kda_decay` runs fla's `fused_kda_gate` on CUDA when `fused` (a model's
`KernelSettings.fused_rowwise`), and `naive_kda_decay` otherwise."""

from models.ops.dispatch import use_fused_rowwise
from models.ops.gate.fused import fused_kda_decay
from models.ops.gate.naive import naive_kda_decay


def kda_decay(f_THK, A_log, dt_bias, *, fused=True):
    """Signature and returns of `models.ops.gate.naive.naive_kda_decay`; `fused`: the kernel where it can run."""
    return (fused_kda_decay if use_fused_rowwise(f_THK, fused) else naive_kda_decay)(f_THK, A_log, dt_bias)


__all__ = ["fused_kda_decay", "kda_decay", "naive_kda_decay"]
