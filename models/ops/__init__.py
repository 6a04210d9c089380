"""Linear-attention ops with per-sequence states, and row-wise ops: each has a plain-torch reference (`naive.py`, CPU,
float64-capable) and a fast path with the same signature (fla's kernels, or the project's own Triton kernels for
RMSNorm and the MoE combine); the dispatchers pick the fast path for CUDA tensors that are not float64, the
reference otherwise. The row-wise ops (rms_norm, l2_norm, swiglu, sigmoid_gate, moe_combine, kda_decay) take it unless
the caller passes `fused=False`: a model's `settings.KernelSettings.fused_rowwise` (`train.fused_rowwise = false`, the
benchmarks' `--reference-rowwise`).

    models.ops.kda.kda_core      KDA delta-rule core      (naive_chunk_kda / chunk_kda)
    models.ops.gdn.gdn_core      GDN delta-rule core      (naive_chunk_gdn / chunk_gdn)
    models.ops.conv.short_conv   short causal conv        (naive_causal_conv1d / causal_conv1d)
    models.ops.norm.gated_rms_norm  gated RMSNorm         (naive_rms_norm_gated / rms_norm_gated)
    models.ops.rmsnorm.rms_norm     RMSNorm (+ residual)  (naive_rms_norm / fused_rms_norm, own Triton kernels)
    models.ops.l2norm.l2_norm       q/k L2 norm           (naive_l2_norm / fused_l2_norm, own Triton kernels)
    models.ops.glu.swiglu           silu(gate) * up       (naive_swiglu / fused_swiglu)
    models.ops.glu.sigmoid_gate     x * sigmoid(gate)     (naive_sigmoid_gate / fused_sigmoid_gate)
    models.ops.combine.moe_combine  MoE weighted combine  (naive_moe_combine / fused_moe_combine, own Triton kernels)
    models.ops.gate.kda_decay       KDA decay gate        (naive_kda_decay / fused_kda_decay)

Delta-rule cores take packed sequences (`cu_seqlens`), one initial state per sequence and return final states
(differentiable); the chunk partition is in `models.ops.delta_rule.partition`. States at chunk boundaries inside a
sequence come from cutting it there (`models.tree.core_calls`).
fla and triton are imported only when a fast path runs, so importing this package is cheap on CPU.
"""

from models.ops.combine import moe_combine
from models.ops.conv import short_conv
from models.ops.gate import kda_decay
from models.ops.gdn import gdn_core
from models.ops.glu import sigmoid_gate, swiglu
from models.ops.kda import kda_core
from models.ops.l2norm import l2_norm
from models.ops.norm import gated_rms_norm
from models.ops.rmsnorm import rms_norm

__all__ = [
    "gated_rms_norm", "gdn_core", "kda_core", "kda_decay", "l2_norm", "moe_combine", "rms_norm", "short_conv",
    "sigmoid_gate", "swiglu",
]
