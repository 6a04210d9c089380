"""Which implementation an op dispatcher runs: the Triton kernels (fla's, or the project's own for RMSNorm, the GLUs
and the MoE combine) for CUDA tensors, the plain-torch reference otherwise (CPU, and float64 anywhere: the kernels
are not float64).

fla memoises per-call chunk indices by the identity of `cu_seqlens` in queues of 4 entries (`FLA_TENSOR_CACHE_SIZE`);
tree execution issues more distinct packed calls per layer than that (`models.tree.core_calls`), and every miss
costs a host-device copy, i.e. a stream synchronisation. A default of 64 is set here, before fla is first imported
(models/ only imports fla lazily, inside the fast paths); an explicit environment setting wins.
"""

import os

import torch

os.environ.setdefault("FLA_TENSOR_CACHE_SIZE", "64")


def use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64


_fused_rowwise = True


def set_fused_rowwise(enabled: bool) -> None:
    """Turn the fused row-wise paths (issue #20: `rmsnorm`, `l2norm`, `glu`, `gate`, `combine`) on or off for this process.

    On by default: all 49 cases of tests/models/ops/test_rowwise_cuda.py pass on the H200, the bf16 tree's layer
    outputs stay bitwise equal to flat (`bench.fidelity --per-layer`), and every mode runs faster (measurements:
    models/ops/README.md). Off = the plain-torch references. The RL job sets it from `train.fused_rowwise`, the
    benchmarks from `--reference-rowwise`."""
    global _fused_rowwise
    _fused_rowwise = bool(enabled)


def use_fused_rowwise(x: torch.Tensor) -> bool:
    """The fused row-wise path for `x`: switched on (`set_fused_rowwise`) and a tensor the kernels take."""
    return _fused_rowwise and use_fla(x)
