"""Which implementation an op dispatcher runs: the Triton kernels (fla's, or the project's own for RMSNorm) for CUDA
tensors, the plain-torch reference otherwise (CPU, and float64 anywhere: the kernels are not float64).

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
