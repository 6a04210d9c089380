"""Run unmodified model code on parameter shards: DTensor parameters that read as their local tensors.

The mixers of `models/` index their parameters directly (`self.A_log`, `self.conv1d.weight[:, 0, :]`) and are called
step by step by tree execution, so hooks on `forward` cannot localise them. Instead a module that holds sharded
parameters gets the `LocalParams` mixin (its class is swapped for a subclass, as FSDP2's `fully_shard` does): while
FSDP2 has gathered a parameter (it is then a DTensor on the model-parallel mesh), attribute access returns
`param.to_local(grad_placements=...)`, optionally a row selection of it. Storage, state_dict keys and DCP see the
DTensor; only the forward code sees local tensors.

Placements used (mesh: the tp or ep mesh):
  Shard(d):   rank r holds slice r of dim d; its gradient is that slice's gradient.
  Replicate with Partial gradient: every rank holds the whole (small) tensor but uses only the part of its own heads
              (norm weights shared by heads, low-rank gate projections, the q|k|v conv); the full gradient is the
              sum over ranks, which FSDP2 performs when it redistributes the gradient to Replicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

__all__ = ["LocalParams", "LocalSpec", "swap_class", "shard_param", "replicate_param"]


@dataclass(frozen=True)
class LocalSpec:
    """How forward code sees one DTensor parameter."""

    mesh: DeviceMesh
    """Mesh of the gathered parameter; DTensors on any other mesh (FSDP2's sharded storage) are left alone."""
    grad_placements: tuple[Placement, ...]
    """Placements of the local gradient (Partial for replicated parameters that each rank uses in part)."""
    rows: torch.Tensor | None = None
    """Dim-0 indices this rank reads of a replicated parameter (None = all of the local tensor)."""


class LocalParams:
    """Mixin: DTensor parameters listed in `_local_specs` read as local tensors (see the module docstring)."""

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        if isinstance(value, DTensor):
            spec = self.__dict__["_local_specs"].get(name)
            if spec is not None and value.device_mesh == spec.mesh:
                local = value.to_local(grad_placements=spec.grad_placements)
                return local if spec.rows is None else local.index_select(0, spec.rows.to(local.device))
        return value


@cache
def _local_subclass(cls: type) -> type:
    return type(f"Local{cls.__name__}", (LocalParams, cls), {})


def swap_class(module: nn.Module, cls: type | None = None) -> None:
    """Give `module` the class `cls` (a subclass of its class that includes LocalParams), or `Local<its class>`."""
    if cls is None:
        cls = module.__class__ if isinstance(module, LocalParams) else _local_subclass(module.__class__)
    if not issubclass(cls, module.__class__) or not issubclass(cls, LocalParams):
        raise TypeError(f"{cls.__name__} must subclass both {module.__class__.__name__} and LocalParams")
    module.__class__ = cls
    module.__dict__.setdefault("_local_specs", {})


def _register(module: nn.Module, name: str, tensor: DTensor, spec: LocalSpec) -> None:
    old = module._parameters[name]
    module._parameters[name] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    if not isinstance(module, LocalParams):
        swap_class(module)
    module.__dict__["_local_specs"][name] = spec


def shard_param(module: nn.Module, name: str, mesh: DeviceMesh, dim: int) -> None:
    """Replace parameter `name` of `module` by a DTensor sharded on `dim` over `mesh` (rank r keeps slice r)."""
    param = module._parameters[name]
    tensor = distribute_tensor(param.detach(), mesh, [Shard(dim)])
    _register(module, name, tensor, LocalSpec(mesh, (Shard(dim),)))


def replicate_param(module: nn.Module, name: str, mesh: DeviceMesh, rows: torch.Tensor | None = None) -> None:
    """Replace parameter `name` by a DTensor replicated over `mesh` whose local use is partial: forward reads
    `rows` of it (or all), and the gradient is summed over `mesh`."""
    param = module._parameters[name]
    tensor = distribute_tensor(param.detach(), mesh, [Replicate()])
    _register(module, name, tensor, LocalSpec(mesh, (Partial(),), rows))
