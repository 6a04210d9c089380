"""Device meshes of one job: a dense view (pp, dp_replicate, dp_shard, tp) and an expert view (pp, dp_replicate,
efsdp, ep) of the same ranks, as torchtitan 0.3.0's `ParallelDims.build_mesh` builds them (cp = 1).

tp is innermost so that tensor-parallel groups are neighbouring ranks (one node); dp_replicate is outermost of the
data dimensions (across nodes for HSDP). Expert parallelism borrows from the dp_shard x tp ranks of one replica
group: they are unflattened into efsdp x ep (ep innermost, efsdp = dp_shard * tp / ep). Every one of those ranks
holds different rows in an MoE layer (different replicas' microbatches, and under tp > 1 different slices of the
same rows: `parallel.expert_parallel`), so an ep group exchanges rows by all-to-all and efsdp groups sum expert
gradients. With dp_shard = tp = 2 (ranks 2 s + t): ep = 2 groups the tp pair {2 s, 2 s + 1}, efsdp the replicas;
ep = 4 groups all four ranks.
FSDP2 + DTensor need a parameter's data-parallel and model-parallel meshes to come from one root: dense parameters
use the dense view (tp, dp_shard), routed experts the expert view (ep, efsdp).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import ParallelConfig

__all__ = ["ParallelMeshes", "build_meshes"]


@dataclass
class ParallelMeshes:
    config: ParallelConfig
    """The resolved degrees."""
    dense: DeviceMesh
    """("pp", "dp_replicate", "dp_shard", "tp")."""
    expert: DeviceMesh
    """("pp", "dp_replicate", "efsdp", "ep"), efsdp = dp_shard * tp / ep."""
    dp: DeviceMesh
    """The D data-parallel replicas (dp_replicate x dp_shard flattened): planner DP rank = `dp.get_local_rank()`;
    step counts and metrics are summed here."""

    @property
    def tp(self) -> DeviceMesh:
        return self.dense["tp"]

    @property
    def ep(self) -> DeviceMesh:
        return self.expert["ep"]

    @property
    def dense_fsdp(self) -> DeviceMesh:
        """FSDP2 mesh of every non-expert parameter: ("dp_replicate", "dp_shard") for HSDP, else ("dp_shard",)."""
        if self.config.dp_replicate > 1:
            return self.dense["dp_replicate", "dp_shard"]
        return self.dense["dp_shard"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """FSDP2 mesh of routed experts under expert parallelism: the ranks holding the same experts."""
        if self.config.dp_replicate > 1:
            return self.expert["dp_replicate", "efsdp"]
        return self.expert["efsdp"]

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()


def build_meshes(config: ParallelConfig, device_type: str) -> ParallelMeshes:
    """Build both views for a resolved config (needs an initialised default process group)."""
    c = config
    dense = init_device_mesh(device_type, (c.pp, c.dp_replicate, c.dp_shard, c.tp),
                             mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    expert = init_device_mesh(device_type, (c.pp, c.dp_replicate, c.dp_shard * c.tp // c.ep, c.ep),
                              mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    dp = dense["dp_replicate", "dp_shard"]._flatten("dp")
    return ParallelMeshes(config, dense, expert, dp)
