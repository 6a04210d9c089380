"""FSDP2 wrapping of the hybrid decoder: one unit per decoder layer, routed experts on their own mesh, and the root.

Units: each decoder layer (mixer, norms, MLP or router + shared expert), under expert parallelism the routed experts
of each MoE layer (sharded over the ranks that hold the same experts: `ParallelMeshes.expert_fsdp`, which under
tp > 1 may include tp ranks, since those route different rows there), and the root (embeddings, final norm,
LM head; FSDP2 keeps root parameters gathered from forward to backward, which the LM head read by the log-probs
needs). Gradients are summed, not averaged, across replicas: the loss of every microbatch is already divided by
the global normaliser of the step (`parallel.runner`), so the sum over replicas is the gradient of the step loss.
On gloo, reduce-scatter cannot take PREMUL_SUM (measured on torch 2.13 and 2.14), so reductions are forced to SUM.

Under pipeline parallelism every stage part of this rank is a root of its own, with its layers as units, and
layers are not resharded after forward by default (torchtitan's policy: every microbatch would gather the
parameters again).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from models.decoder import DecoderLayer
from models.dtypes import DTYPES
from models.moe import MoE
from parallel.config import ParallelConfig
from parallel.mesh import ParallelMeshes

__all__ = ["apply_fsdp"]


def apply_fsdp(roots: Sequence[nn.Module], meshes: ParallelMeshes, config: ParallelConfig, *,
               pp_enabled: bool = False) -> None:
    """fully_shard the units above (in place): `roots` is the whole model, or this rank's pipeline stage parts
    (`pp_enabled`). Degree-1 meshes still get FSDP2, for its mixed-precision casts and the DTensor gradient
    handling of tensor/expert-parallel parameters."""
    compute = lambda name: None if name == "model" else DTYPES[name]  # noqa: E731  ("model": keep the dtype)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=compute(config.param_dtype),
        reduce_dtype=compute(config.reduce_dtype),
        # Inputs keep their dtype (fp32 positions and row weights stay fp32).
        cast_forward_inputs=False,
    )
    reshard = config.reshard_after(pp_enabled)
    for root in roots:
        for layer in [m for m in root.modules() if isinstance(m, DecoderLayer)]:
            if config.ep > 1 and isinstance(layer.mlp, MoE):
                fully_shard(layer.mlp.experts, mesh=meshes.expert_fsdp, mp_policy=mp_policy,
                            reshard_after_forward=reshard)
            fully_shard(layer, mesh=meshes.dense_fsdp, mp_policy=mp_policy, reshard_after_forward=reshard)
        fully_shard(root, mesh=meshes.dense_fsdp, mp_policy=mp_policy)
    gloo = dist.get_backend() == "gloo"
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                if gloo:
                    module.set_force_sum_reduction_for_comms(True)
