"""Where the policy is trained: the `Trainer` contract, implemented by `LocalTrainer` (one process) and
`app.distributed_trainer.DistributedTrainer` (every rank of a torchrun launch). The job (app.job) drives either:

    share(fn)            run fn on the main rank (rollout, planning) and hand its result (or its error) to every rank
    set_lr(lr)           learning rate of the next optimizer step
    policy()             the full policy as a plain model on the main rank (the HF export), else None
    freeze_reference()   the KL reference becomes a frozen copy of the current policy
    own(folder, key)     lock an output folder for this run (app.folder_lock); `checkpoint.dir` is locked at start
    save(step, state)    checkpoint the trainer and the job's own `state` (JSON values); restore() returns that dict
    set_aside_checkpoints() a fresh run's start: move the checkpoints in `checkpoint.dir` to its `previous-run`
                         folder, deleted once this run has a checkpoint of its own
    close()              release the folders

and reads `model`, `optimizer`, `reference`, `device`, `dp`, `dp_rank`, `dp_group`, `pp_group`, `is_main`, and
`notes` (one-line reports to print: a stale lock taken over, unfinished checkpoint writes removed, incomplete
checkpoints skipped).
It runs the step's microbatches with `runner` (and `reference_runner` for the KL reference's log-probs), the step
runner (`parallel.runner.StepRunner`) that the trainer's wrapping of the model needs.

Both write app.checkpoint's format (DCP tensors + job.json), so a run moves between one process and N ranks.
One process: the plain model on the trainer device, torch AdamW.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from app.checkpoint import Checkpointer
from app.config import JobConfig
from app.folder_lock import FolderLock
from models.decoder import HybridForCausalLM
from parallel.checkpoint import TrainingState
from parallel.plain_runner import PlainRunner
from parallel.ranks import share
from parallel.runner import StepRunner

__all__ = ["Trainer", "LocalTrainer", "frozen"]

T = TypeVar("T")


def frozen(model: nn.Module) -> nn.Module:
    """`model` in eval mode with gradients off (in place)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class Trainer:
    """The base of both trainers: the contract above, with everything but `policy`, `freeze_reference` and
    `_runner_for` implemented here. A subclass calls `super().__init__(config)` first (it locks the checkpoint
    folder before any model work), then sets the attributes below."""

    model: nn.Module
    """The policy being trained: a HybridForCausalLM (wrapped by FSDP2 / TP / EP on a rank), or this rank's pipeline
    stages (parallel.pipeline.PipelinedCausalLM)."""
    optimizer: torch.optim.Optimizer
    optimizers: tuple[torch.optim.Optimizer, ...]
    """The torch optimizers that `optimizer` steps."""
    reference: nn.Module | None
    """The frozen KL reference (same layout as `model`) once `freeze_reference` ran or a checkpoint restored it."""
    device: torch.device
    dp: int
    dp_rank: int
    dp_group: Any
    pp_group: Any = None
    """The pipeline group when `model` holds this rank's pipeline stages (the weight sync gathers the others' from
    it), else None."""
    is_main: bool
    checkpoints: Checkpointer
    notes: list[str]
    runner: StepRunner
    """Runs `model`'s microbatches (train_step, score, clipping)."""

    def __init__(self, config: JobConfig) -> None:
        self.checkpoints = Checkpointer(config.checkpoint.dir, config.checkpoint.keep)
        self.notes = []
        self._wants_reference = config.reference_policy
        self._locks: dict[Path, FolderLock] = {}
        self.own(config.checkpoint.dir, "checkpoint.dir")

    def policy(self) -> HybridForCausalLM | None:
        """The full policy as a plain model on the main rank, else None."""
        raise NotImplementedError

    def freeze_reference(self) -> None:
        """Make the KL reference a frozen copy of the current policy."""
        raise NotImplementedError

    def _runner_for(self, model: nn.Module) -> StepRunner:
        """The step runner of `model` (the policy, or the reference in the same layout)."""
        raise NotImplementedError

    @property
    def reference_runner(self) -> StepRunner | None:
        """Scores with `reference` once there is one."""
        return None if self.reference is None else self._runner_for(self.reference)

    def share(self, fn: Callable[[], T]) -> T:
        """fn() on the main rank, its result (or the exception it raised) on every rank."""
        return share(fn)

    def set_lr(self, lr: float) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def own(self, folder: str | None, key: str) -> None:
        """Lock output folder `folder` (config key `key`; None: nothing) until `close`, creating it. Raises
        ConfigError on every rank when another run owns it or it cannot be written; a stale lock taken over is
        added to `notes`."""
        if folder is None:
            return

        def take() -> str | None:
            path = Path(folder).resolve()
            if path in self._locks:
                return None
            self._locks[path] = lock = FolderLock(path, key)
            return lock.took_over

        took_over = self.share(take)
        if took_over is not None:
            self.notes.append(f"`{key}` = {folder}: took over the lock of a run that ended without releasing it "
                              f"({took_over})")

    def _state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizers, self.reference)

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Checkpoint `step` (every rank writes its shards) with the job's `state` (JSON values, the main rank's
        kept); returns the step's folder. Raises app.checkpoint.NonFiniteError, writing nothing, for NaN / inf
        weights, and app.checkpoint.CheckpointWriteError when the write fails (the older checkpoints are kept)."""
        return str(self.checkpoints.save(step, self._state(), state))

    def restore(self) -> dict[str, Any]:
        """Load the newest usable checkpoint; returns the job's state plus "path" (its folder)."""

        def state_for(groups: set[str]) -> TrainingState:
            if "reference" in groups and self._wants_reference:
                self.freeze_reference()
            return self._state()

        found = self.checkpoints.restore(state_for)
        self.notes += found.notes
        return {**found.job, "path": str(found.path)}

    def set_aside_checkpoints(self) -> int:
        """Move the checkpoints in `checkpoint.dir` to its `previous-run` folder (unfinished writes are removed);
        returns how many there were."""
        return self.checkpoints.set_aside()

    def close(self) -> None:
        """Release the folders this run owns."""
        for lock in self._locks.values():
            lock.release()
        self._locks.clear()


class LocalTrainer(Trainer):
    """The policy in this process (`model` is built on the CPU, moved to `device` here)."""

    is_main = True
    dp = 1
    dp_rank = 0
    dp_group = None

    def __init__(self, config: JobConfig, model: HybridForCausalLM, device: torch.device) -> None:
        super().__init__(config)
        c = config
        self.device = device
        self.model = model.to(device)
        self.model.set_activation_checkpointing(c.parallel.recompute())
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=c.train.lr, betas=tuple(c.train.betas), weight_decay=c.train.weight_decay
        )
        self.optimizers = (self.optimizer,)
        self.reference: HybridForCausalLM | None = None
        self.attention_backend = c.train.attention_backend
        self.carry_resident = c.planner.carry_resident
        self.runner = self._runner_for(self.model)

    def _runner_for(self, model: nn.Module) -> PlainRunner:
        return PlainRunner(model, attention_backend=self.attention_backend, resident=self.carry_resident)

    def policy(self) -> HybridForCausalLM:
        return self.model

    def freeze_reference(self) -> None:
        self.reference = frozen(copy.deepcopy(self.model))
