"""The policy trained by every rank of a torchrun launch (see docs/distributed.md).

Rank 0 is the main rank: it gathers the trees every rank's engine built (app.rl_job), computes advantages and plans
the step's microbatches with the job's DP degree D; `share` broadcasts that result (or the error it raised) to every
rank.
Every rank then trains its DP replica's step (`parallel.replica.prepare_step`) with its step runner:
`parallel.plain_runner.PlainRunner` (steps of every planner mode) on the model wrapped by
`parallel.parallelize_for_job` (TP / EP, activation checkpointing, compile, FSDP2), or with `parallel.pp` > 1 (torch
>= 2.14) `parallel.pipeline_runner.PipelineRunner` on its pipeline stages, `parallel.pipeline.pipeline_for_job`
(every pp rank of a replica holds the replica's step).

- Optimizer: torchtitan's `OptimizersContainer` (AdamW; FQN-keyed state that DCP can reshard).
- Weights for the rollout engines: app.weight_sync streams them from the shards into every rank's engine, one
  parameter at a time (`pp_group` under pipeline parallelism). For the HF export, `policy()` gathers the full state
  dict from the shards (a collective) into a plain CPU model on rank 0 only, built for the call; under pipeline
  parallelism the other stages' weights come to rank 0 from the ranks of its pp group.
- Checkpoints: app.checkpoint's format, as in one process (app.trainer.Trainer): every rank writes its shards of
  the model, the optimizer state and the KL reference with DCP (under pipeline parallelism its stages' entries, named
  as in the whole model), rank 0 the job's state; DCP reshards on load, so a run resumes under any layout, on any
  number of ranks, or in one process, and back.
- Metrics and console output come from rank 0 only (app.rl_job).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from app.config import JobConfig
from app.trainer import Trainer, frozen
from models.decoder import HybridForCausalLM
from parallel.checkpoint import build_optimizers
from parallel.launch import DistributedJob, parallelize_for_job
from parallel.pipeline import pipeline_for_job
from parallel.pipeline_runner import PipelineRunner
from parallel.plain_runner import PlainRunner
from parallel.runner import StepRunner

__all__ = ["DistributedTrainer"]


class DistributedTrainer(Trainer):
    """The rank's part of the policy. `model` must be built identically on every rank (same seed), on the CPU."""

    def __init__(self, config: JobConfig, model: HybridForCausalLM, job: DistributedJob) -> None:
        super().__init__(config)
        c = config
        self.job = job
        self.device = job.device
        self.is_main = job.rank == 0
        self.dp = job.config.dp
        self.dp_rank = job.dp_rank
        self.dp_group = job.meshes.dp.get_group()
        self.model_config = model.config
        pipelined = job.config.pp > 1
        wrap, self._runner_class = ((pipeline_for_job, PipelineRunner) if pipelined
                                    else (parallelize_for_job, PlainRunner))
        # Open carry microbatches kept on the device: only PlainRunner runs carry steps.
        self._runner_options = {"attention_backend": c.train.attention_backend,
                                **({} if pipelined else {"resident": c.planner.carry_resident})}
        # The KL reference is wrapped now, like the policy; it is the policy's copy once RL begins (freeze_reference).
        self._reference = frozen(wrap(copy.deepcopy(model), job)) if c.reference_policy else None
        self._reference_frozen = False
        self.model = wrap(model, job)
        self.pp_group = self.model.pp_group if job.config.pp > 1 else None
        self.optimizer = build_optimizers(self.model, lr=c.train.lr, weight_decay=c.train.weight_decay,
                                          betas=tuple(c.train.betas), implementation="for-loop")
        self.optimizers = tuple(self.optimizer)
        self.runner = self._runner_for(self.model)

    def close(self) -> None:
        """Release the folders, then this rank's process group (one left to the interpreter's exit is a usual source
        of "terminate called without an active exception": a full-suite run once saw a rank abort so after a finished
        4-rank job)."""
        super().close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _runner_for(self, model: nn.Module) -> StepRunner:
        return self._runner_class(model, dp_group=self.dp_group, **self._runner_options)

    @property
    def reference(self) -> nn.Module | None:
        return self._reference if self._reference_frozen else None

    def policy(self) -> HybridForCausalLM | None:
        """Gather the full weights (every rank takes part) into a plain CPU model on rank 0, built for this call (no
        copy is kept between calls: the rollout engines get their weights from the shards), None elsewhere."""
        full = self.runner.full_state_dict()
        if not self.is_main:
            return None
        with torch.device("meta"):
            policy = HybridForCausalLM(self.model_config)
        policy.load_state_dict(full, strict=True, assign=True)
        return policy

    @torch.no_grad()
    def freeze_reference(self) -> None:
        self._reference.load_state_dict(self.model.state_dict())
        self._reference_frozen = True
