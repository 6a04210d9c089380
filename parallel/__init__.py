"""Distributed training of the hybrid models on rollout-tree microbatches (see README "Distributed training").

Entry points: `ParallelConfig` (degrees), `init_distributed` (torchrun env -> process group, device, meshes),
`parallelize_hybrid` / `parallelize_for_job` (TP/EP -> AC -> compile -> FSDP2), `train_step` (one replica's
microbatches: forward, loss, backward), `clip_grad_norm_`, and `parallel.checkpoint` (DCP checkpoints of a trainer).
"""

from parallel.config import ParallelConfig
from parallel.grad_norm import clip_grad_norm_
from parallel.launch import DistributedJob, init_distributed, parallelize_for_job
from parallel.parallelize import parallelize_hybrid
from parallel.step import train_step

__all__ = ["ParallelConfig", "DistributedJob", "init_distributed", "parallelize_for_job", "parallelize_hybrid",
           "train_step", "clip_grad_norm_"]
