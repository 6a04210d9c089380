"""The policy trained by every rank of a torchrun launch (see README "Distributed training").

Rank 0 is the main rank: it runs the rollout engine, builds the trees, computes advantages and plans the step's
microbatches with the job's DP degree D; `share` broadcasts that result (or the error it raised) to every rank.
Every rank then trains its DP replica's microbatches (`parallel.replica.prepare_replica`) with its step runner:
`parallel.plain_runner.PlainRunner` on the model wrapped by `parallel.parallelize_for_job` (TP / EP, activation
checkpointing, compile, FSDP2), or with `parallel.pp` > 1 (torch >= 2.14) `parallel.pipeline_runner.PipelineRunner`
on its pipeline stages, `parallel.pipeline.pipeline_for_job` (every pp rank of a replica holds the replica's
microbatches).

- Optimizer: torchtitan's `OptimizersContainer` (AdamW; FQN-keyed state that DCP can reshard).
- Weights for the engine and the HF export: `policy()` gathers the full state dict from the shards (a collective)
  into a plain CPU copy of the model held by rank 0 only; under pipeline parallelism the other stages' weights
  come to rank 0 from the ranks of its pp group.
- Checkpoints: torchtitan's DCP `CheckpointManager` (`parallel.checkpoint`) in `checkpoint.dir/step-N`, one shard
  file per rank (under pipeline parallelism each rank saves its stages' entries, named as in the whole model); a
  folder counts only once its `.metadata` is written. The job's own state (step counters, run name, rank 0's RNG
  states, the KL reference's shards) is saved with it. A run resumes under any launch whose layout DCP can reshard
  to, not from the single-process format (and vice versa).
- Metrics and console output come from rank 0 only (app.rl_job).
"""

from __future__ import annotations

import copy
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from app.config import JobConfig
from app.config_loader import ConfigError
from app.trainer import frozen
from models.decoder import HybridForCausalLM
from parallel.checkpoint import build_checkpointer, build_optimizers
from parallel.launch import DistributedJob, parallelize_for_job
from parallel.pipeline import pipeline_for_job
from parallel.pipeline_runner import PipelineRunner
from parallel.plain_runner import PlainRunner

__all__ = ["DistributedTrainer"]

T = TypeVar("T")

_STEP_FOLDER = re.compile(r"^step-\d+$")


class _JobState:
    """DCP `Stateful` of what the job saves besides model and optimizer: its state dict (small Python values,
    stored as one pickled blob, equal on every rank) and the KL reference's parameter shards."""

    def __init__(self, reference: HybridForCausalLM | None) -> None:
        self.values: dict[str, Any] = {}
        self.reference = reference

    def state_dict(self) -> dict[str, Any]:
        state = {"job": pickle.dumps(self.values)}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = pickle.loads(state["job"])
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])


class DistributedTrainer:
    """The rank's part of the policy. `model` must be built identically on every rank (same seed), on the CPU."""

    def __init__(self, config: JobConfig, model: HybridForCausalLM, job: DistributedJob) -> None:
        c = config
        if c.checkpoint.keep < 2:
            raise ConfigError(f"`checkpoint.keep` = {c.checkpoint.keep}: torchrun launches checkpoint with "
                              "torchtitan's CheckpointManager, which keeps at least 2; set keep >= 2")
        self.job = job
        self.device = job.device
        self.is_main = job.rank == 0
        self.dp = job.config.dp
        self.dp_rank = job.dp_rank
        self.dp_group = job.meshes.dp.get_group()
        self.full_copy = copy.deepcopy(model) if self.is_main else None
        wrap, runner = (pipeline_for_job, PipelineRunner) if job.config.pp > 1 else (parallelize_for_job, PlainRunner)
        options = {"dp_group": self.dp_group, "attention_backend": c.train.attention_backend}
        # The KL reference exists from the start so that every checkpoint has the same entries; it is set to the
        # policy when RL begins (freeze_reference).
        self.reference = frozen(wrap(copy.deepcopy(model), job)) if c.rl.kl_coef > 0 else None
        self.reference_runner = None if self.reference is None else runner(self.reference, **options)
        self.model = wrap(model, job)
        self.runner = runner(self.model, **options)
        self.optimizer = build_optimizers(self.model, lr=c.train.lr, weight_decay=c.train.weight_decay,
                                          betas=tuple(c.train.betas), implementation="for-loop")
        self.folder = Path(c.checkpoint.dir)
        self.state = _JobState(self.reference)
        self.checkpointer = build_checkpointer(self.model, self.optimizer, None, self.state, folder=str(self.folder),
                                               interval=1, keep_latest_k=c.checkpoint.keep)

    def share(self, fn: Callable[[], T]) -> T:
        """fn() on rank 0, its result broadcast to every rank; an exception raised by fn is raised on every rank."""
        payload: list[Any] = [None]
        if self.is_main:
            try:
                payload[0] = (True, fn())
            except Exception as e:  # every rank must leave the broadcast, then all raise it
                payload[0] = (False, e)
        dist.broadcast_object_list(payload, src=0)
        ok, value = payload[0]
        if not ok:
            raise value
        return value

    def set_lr(self, lr: float) -> None:
        for optimizer in self.optimizer:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def policy(self) -> HybridForCausalLM | None:
        """Gather the full weights (every rank takes part) into rank 0's CPU copy and return it (None elsewhere)."""
        full = self.runner.full_state_dict()
        if not self.is_main:
            return None
        self.full_copy.load_state_dict(full)
        return self.full_copy

    @torch.no_grad()
    def freeze_reference(self) -> None:
        self.reference.load_state_dict(self.model.state_dict())

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Checkpoint `step` (every rank writes its shards); `state` is taken from rank 0 (its RNG states are the
        ones that matter: the engine's). Returns the step's folder."""
        shared = [state]
        dist.broadcast_object_list(shared, src=0)
        self.state.values = shared[0]
        self.checkpointer.save(step)
        return str(self.folder / f"step-{step}")

    def restore(self) -> dict[str, Any]:
        if not self.checkpointer.load():
            raise ConfigError(f"`checkpoint.resume`: no distributed (DCP) checkpoint in {self.folder}; run without "
                              "--resume to start fresh")
        return {**self.state.values, "path": str(self.folder / f"step-{self._latest_step()}")}

    def _latest_step(self) -> int:
        return max(int(p.name.split("-")[1]) for p in self.folder.iterdir()
                   if _STEP_FOLDER.match(p.name) and (p / ".metadata").is_file())

    def remove_checkpoints(self) -> int:
        """Rank 0 deletes every `step-N` folder in the checkpoint folder; returns how many there were."""
        removed = 0
        if self.is_main and self.folder.is_dir():
            for p in self.folder.iterdir():
                if p.is_dir() and _STEP_FOLDER.match(p.name):
                    shutil.rmtree(p)
                    removed += 1
        dist.barrier()
        return removed

    def close(self) -> None:
        self.checkpointer.close()
