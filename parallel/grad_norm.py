"""Gradient norm and clipping over a parallelized model whose gradients live on different meshes.

After `parallelize_hybrid`, dense gradients are DTensors on the dense mesh (dp x tp) and routed-expert gradients on
the expert mesh (dp x ep); `torch.nn.utils.clip_grad_norm_` cannot stack norms of DTensors from different meshes.
Here each mesh's norm is reduced to a plain scalar first (DTensor reductions count replicated shards once), then the
norms are combined; plain gradients (single process) are handled the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients of `model` in place so their global `norm_type` norm is at most `max_norm`; returns the
    norm before clipping (a plain scalar tensor, equal on every rank)."""
    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    norms = []
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if key is not None else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total
