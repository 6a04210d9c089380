"""Distributed training of the hybrid models on rollout-tree microbatches (docs/distributed.md).

Entry points: `ParallelConfig` (degrees), `init_distributed` (torchrun env -> process group, device, meshes),
`parallelize_hybrid` / `parallelize_for_job` (TP/EP -> AC -> compile -> FSDP2), `prepare_step` (one replica's step
of a step plan, any planner mode), the step runners (`StepRunner`: `PlainRunner`, and `parallel.pipeline_runner.
PipelineRunner` for pipeline stages: forward, loss, backward, clipping), and `parallel.checkpoint` (DCP checkpoints
of a trainer).
"""

from parallel.config import ParallelConfig
from parallel.launch import DistributedJob, init_distributed, parallelize_for_job
from parallel.parallelize import parallelize_hybrid
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from parallel.runner import StepRunner

__all__ = ["ParallelConfig", "DistributedJob", "init_distributed", "parallelize_for_job", "parallelize_hybrid",
           "prepare_step", "StepRunner", "PlainRunner"]
