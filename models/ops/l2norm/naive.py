"""Plain-torch L2 normalisation over the last dim: the q/k norm of the linear-attention mixers (fla's and
transformers' `l2norm`).

Legend: ... leading dims (rows, heads), K normalised dim.
"""

import torch

from models.dtypes import upcast


def naive_l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim `[..., K]`, computed in fp32 (float64 stays float64) and rounded
    once to x.dtype."""
    xf = x.to(upcast(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
