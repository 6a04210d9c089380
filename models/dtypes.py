"""Dtype names of configs and the compute dtype of reductions (fp32, float64 for float64 models)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def upcast(dtype: torch.dtype) -> torch.dtype:
    """Dtype for norms, gates, router and softmax: float64 stays float64 (exactness tests), all else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mm_upcast(a_MK: torch.Tensor, b_KN: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """[M, N] product in the compute dtype `cdt`, accumulated there and never rounded to a low-precision input dtype.
    bf16/fp16 on CUDA: one cuBLAS call writing fp32 (tensor cores; no product in the input dtype, no cast copy);
    elsewhere the inputs are cast to `cdt` first (the same exact products, summed in `cdt`)."""
    if a_MK.dtype == cdt:
        return a_MK @ b_KN
    if a_MK.is_cuda and cdt == torch.float32:
        return torch.mm(a_MK, b_KN, out_dtype=cdt)
    return a_MK.to(cdt) @ b_KN.to(cdt)
