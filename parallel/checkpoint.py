"""Distributed checkpoints of a parallelized model with torchtitan's DCP `CheckpointManager`.

torchtitan pieces used as they are: `CheckpointManager` (torch.distributed.checkpoint save/load of every rank's
shards, step folders `step-N`, interval and retention policy, optional async save, resume from the latest step),
`OptimizersContainer` (AdamW over the DTensor parameters, FQN-keyed optimizer state that DCP can reshard) and
`LRSchedulersContainer` (warmup + decay). Checkpoints are keyed by our parameter names (transformers' names), so a
run can resume under a different layout (e.g. FSDP2 + EP -> FSDP2 + TP): DCP reshards on load.

torchtitan is imported here only (torch >= 2.13 with triton; see README "Distributed training").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

__all__ = ["TrainState", "build_optimizers", "build_lr_schedulers", "build_checkpointer"]


@dataclass
class TrainState:
    """The loop's own state, saved with the model (a DCP `Stateful`)."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def build_optimizers(model: nn.Module, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8,
                     implementation: Literal["for-loop", "foreach", "fused"] = "foreach"):
    """torchtitan `OptimizersContainer` with one AdamW group over every trainable parameter."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})
    config = OptimizersContainer.Config(param_groups=[group], implementation=implementation)
    return OptimizersContainer(config, model_parts=[model])


def build_lr_schedulers(optimizers, *, warmup_steps: int, training_steps: int,
                        decay_type: Literal["linear", "sqrt", "cosine"] = "linear", min_lr_factor: float = 0.0):
    """torchtitan `LRSchedulersContainer`: linear warmup, then decay to `min_lr_factor` over the remaining steps."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    config = LRSchedulersContainer.Config(warmup_steps=warmup_steps, decay_type=decay_type,
                                          min_lr_factor=min_lr_factor)
    return config.build(optimizers=optimizers, training_steps=training_steps)


def build_checkpointer(model: nn.Module, optimizers, lr_schedulers, train_state: TrainState, *, folder: str,
                       interval: int, keep_latest_k: int = 2,
                       async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"):
    """torchtitan `CheckpointManager` saving model, optimizer, lr schedulers and `train_state` to `folder/step-N`.

    Usage: `checkpointer.load()` once before training (resumes from the latest step in `folder`, if any);
    `checkpointer.save(step, last_step=...)` after every optimizer step (writes every `interval` steps and at the
    last step, a full training state, not only the model).
    """
    from torchtitan.components.checkpointer import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder=folder, interval=interval, keep_latest_k=keep_latest_k,
                                      async_mode=async_mode, last_save_model_only=False)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={"train_state": train_state}, sd_adapter=None)
