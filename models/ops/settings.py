"""Which kernels a model's ops run, and where compiled kernels and tuned kernel configs live: one settings object,
built by the RL job from `[train]` (`app.job`) or by a benchmark from its flags (`bench.kernel_choice`), held by the
model (`models.decoder.HybridForCausalLM(config, kernels=...)`, `use_kernels`) and handed to each of its modules
that dispatches to a kernel, which passes the op the field it needs (`fused=`, `pair=`).

Nothing here is process-wide: two models in one process may run different kernels. What Triton, fla and
flash-attn-4 read from the environment instead of taking it as an argument (the kernel cache folder, fla's tuned
configs and tensor cache) is set from the same object, once, by `models.ops.kernel_environment.use_kernel_environment`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.ops.tuned_configs import TUNED_CONFIGS
from models.ops.varlen_attention.kernels import CUDA_ATTENTION

__all__ = ["KernelSettings"]


@dataclass(frozen=True, kw_only=True)
class KernelSettings:
    """The defaults are what a model runs unless told otherwise (the RL job's and the benchmarks' defaults but for
    `attention`, whose "auto" they resolve per model: `models.ops.varlen_attention.auto_cuda_attention`)."""

    fused_rowwise: bool = True
    """Run RMSNorm (+ residual), the q/k L2 norm, SwiGLU, the sigmoid gate, KDA's decay gate, the MoE combine and the
    log-probabilities' vocabulary passes on their fused Triton kernels where the tensors allow it (CUDA, not
    float64); false: their plain-torch references (models/ops/README.md, "Row-wise ops")."""
    attention: str = "flash"
    """The CUDA kernel pair of packed causal attention in bf16/fp16, flat and tree alike
    (`models.ops.varlen_attention.CUDA_ATTENTION`): "flash" (torch's FlashAttention-2) or "fa4" (FlashAttention-4,
    the optional flash-attn-4 package; `check_cuda_attention` says whether it can run here). Other tensors run the
    reference."""
    kernel_cache: Path | None = None
    """Triton's cache folder of compiled kernels and fla's autotuning results (`models.ops.kernel_cache`); None: the
    user's TRITON_CACHE_DIR, else the caller's default."""
    tuned_configs: Path = TUNED_CONFIGS
    """The folder of fla kernel configs tuned per GPU (`<folder>/<GPU>/`, `models.ops.tuned_configs`) that fla is
    pointed at for the GPU in use."""

    def __post_init__(self) -> None:
        if self.attention not in CUDA_ATTENTION:
            raise ValueError(f"`attention` must be one of {', '.join(CUDA_ATTENTION)}, got {self.attention!r}")
