"""The optimizer step of the app: clip the global gradient norm through the step runner, then step.

The step is prepared by `parallel.replica.prepare_step` and run by the trainer's
`parallel.runner.StepRunner`; this is what the job does between a step's backward and the next one.
"""

from __future__ import annotations

import torch

from parallel.runner import StepRunner

__all__ = ["optimizer_step"]


def optimizer_step(runner: StepRunner, optimizer: torch.optim.Optimizer, grad_clip: float) -> tuple[float, bool]:
    """Clip the global gradient norm (over every mesh and pipeline stage: `runner.clip_grad_norm_`) and step; a
    non-finite norm skips the update. Returns (norm, stepped). Gradients are zeroed either way."""
    norm = runner.clip_grad_norm_(grad_clip if grad_clip > 0 else float("inf"))
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm), stepped
