"""FSDP2 wrapping of the hybrid decoder: one unit per decoder layer, routed experts on their own mesh, and the root.

Units: each decoder layer (mixer, norms, MLP or router + shared expert), under expert parallelism the routed experts
of each MoE layer (sharded over the ranks that hold the same experts: `ParallelMeshes.expert_fsdp`, which under
tp > 1 may include tp ranks, since those route different rows there), and the root (embeddings, final norm,
LM head; FSDP2 keeps root parameters gathered from forward to backward, which the LM head read by the log-probs
needs). Gradients are summed, not averaged, across replicas: the loss of every microbatch is already divided by
the global normaliser of the step (`parallel.step`), so the sum over replicas is the gradient of the step loss.
On gloo, reduce-scatter cannot take PREMUL_SUM (measured on torch 2.13 and 2.14), so reductions are forced to SUM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from models.decoder import HybridForCausalLM
from models.moe import MoE
from parallel.config import ParallelConfig
from parallel.mesh import ParallelMeshes

__all__ = ["apply_fsdp"]

_DTYPES = {"model": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_fsdp(model: HybridForCausalLM, meshes: ParallelMeshes, config: ParallelConfig) -> None:
    """fully_shard the units above (in place). Degree-1 meshes still get FSDP2, for its mixed-precision casts and
    the DTensor gradient handling of tensor/expert-parallel parameters."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[config.param_dtype],
        reduce_dtype=_DTYPES[config.reduce_dtype],
        # Inputs keep their dtype (fp32 positions and row weights stay fp32).
        cast_forward_inputs=False,
    )
    reshard = config.reshard_after_forward != "never"
    for layer in model.model.layers:
        if config.ep > 1 and isinstance(layer.mlp, MoE):
            fully_shard(layer.mlp.experts, mesh=meshes.expert_fsdp, mp_policy=mp_policy,
                        reshard_after_forward=reshard)
        fully_shard(layer, mesh=meshes.dense_fsdp, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=meshes.dense_fsdp, mp_policy=mp_policy)
    gloo = dist.get_backend() == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if gloo:
                module.set_force_sum_reduction_for_comms(True)
