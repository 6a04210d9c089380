"""Start a distributed job from torchrun's environment: process group, device, meshes.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process it starts:
    torchrun --nproc-per-node 8 -m app configs/node-8gpu.toml                         (one node)
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m app configs/multinode.toml   (per node)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.decoder import HybridForCausalLM
from parallel.config import ParallelConfig
from parallel.mesh import ParallelMeshes, build_meshes
from parallel.parallelize import parallelize_hybrid

__all__ = ["DistributedJob", "init_distributed", "parallelize_for_job"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistributedJob:
    """What a rank needs to know about the job it is part of."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    config: ParallelConfig
    """The resolved degrees (dp_shard filled in)."""
    meshes: ParallelMeshes

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: the planner's replica index of the microbatches it runs."""
        return self.meshes.dp_rank


def init_distributed(config: ParallelConfig, device_type: str | None = None) -> DistributedJob:
    """Initialise the default process group from torchrun's environment and build the meshes.

    Args:
        config: degrees (dp_shard may be -1).
        device_type: "cuda" (NCCL, one GPU per process: LOCAL_RANK) or "cpu" (gloo); default: cuda if available.
    """
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variables {missing} are not set: start the job with torchrun (see parallel/launch.py)"
        )
    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: launch at most that "
                "many processes per node (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"`device_type` must be 'cuda' or 'cpu', got {device_type!r}")
    resolved = config.resolved(world_size)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                device_id=device if device_type == "cuda" else None)
    return DistributedJob(rank, world_size, local_rank, device, resolved, build_meshes(resolved, device_type))


def parallelize_for_job(model: HybridForCausalLM, job: DistributedJob) -> HybridForCausalLM:
    """Move `model` (built identically on every rank, e.g. from the same seed or checkpoint) to the job's device
    and wrap it with `parallelize_hybrid`."""
    return parallelize_hybrid(model.to(job.device), job.meshes, job.config)
