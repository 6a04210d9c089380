"""Dtype names of configs and the compute dtype of reductions (fp32, float64 for float64 models)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def upcast(dtype: torch.dtype) -> torch.dtype:
    """Dtype for norms, gates, router and softmax: float64 stays float64 (exactness tests), all else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
