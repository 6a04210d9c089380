"""Where the policy is trained: `LocalTrainer` (one process) and `app.distributed_trainer.DistributedTrainer`
(every rank of a torchrun launch). The job (app.rl_job) drives either through the same methods:

    share(fn)          run fn on the main rank (rollout, planning) and hand its result (or its error) to every rank
    set_lr(lr)         learning rate of the next optimizer step
    policy()           the full policy as a plain model on the main rank (rollout engine, HF export), else None
    freeze_reference() the KL reference becomes a frozen copy of the current policy
    save(step, state)  checkpoint the trainer and the job's own `state` dict; restore() returns that dict
    remove_checkpoints(), close()

One process: the plain model on the trainer device, torch AdamW, atomic checkpoints of app.checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from app.checkpoint import Checkpointer
from app.config import JobConfig
from app.config_loader import ConfigError
from models.decoder import HybridForCausalLM
from parallel.plain_runner import PlainRunner

__all__ = ["LocalTrainer", "frozen"]

T = TypeVar("T")


def frozen(model: HybridForCausalLM) -> HybridForCausalLM:
    """`model` in eval mode with gradients off (in place)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class LocalTrainer:
    """The policy in this process (`model` is built on the CPU, moved to `device` here)."""

    is_main = True
    dp = 1
    dp_rank = 0
    dp_group = None

    def __init__(self, config: JobConfig, model: HybridForCausalLM, device: torch.device) -> None:
        c = config
        self.device = device
        self.model = model.to(device)
        if c.parallel.activation_checkpointing == "full":
            self.model.set_activation_checkpointing(True)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=c.train.lr, betas=tuple(c.train.betas), weight_decay=c.train.weight_decay
        )
        self.runner = PlainRunner(self.model, attention_backend=c.train.attention_backend)
        self.reference: HybridForCausalLM | None = None
        self.reference_runner: PlainRunner | None = None
        self.attention_backend = c.train.attention_backend
        self.checkpoints = Checkpointer(c.checkpoint.dir, c.checkpoint.keep)

    def share(self, fn: Callable[[], T]) -> T:
        return fn()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def policy(self) -> HybridForCausalLM:
        return self.model

    def freeze_reference(self) -> None:
        self.reference = frozen(copy.deepcopy(self.model))
        self.reference_runner = PlainRunner(self.reference, attention_backend=self.attention_backend)

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Write the checkpoint of `step`; returns its folder."""
        return str(self.checkpoints.save(step, {
            **state,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "reference": None if self.reference is None else {
                k: v.detach().cpu() for k, v in self.reference.state_dict().items()
            },
        }))

    def restore(self) -> dict[str, Any]:
        path = self.checkpoints.latest()
        if path is None:
            raise ConfigError(f"`checkpoint.resume`: no checkpoint in {self.checkpoints.root}; "
                              "run without --resume to start fresh")
        state = self.checkpoints.load(path)
        self.model.load_state_dict(state.pop("model"))
        self.optimizer.load_state_dict(state.pop("optimizer"))
        reference = state.pop("reference")
        if reference is not None:
            self.freeze_reference()
            self.reference.load_state_dict(reference)
        state["path"] = str(path)
        return state

    def remove_checkpoints(self) -> int:
        return self.checkpoints.remove_all()

    def close(self) -> None:
        """Nothing to release in one process."""
