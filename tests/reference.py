"""Independent references shared by tests: plain torch, written for clarity, never called by the code under test."""

from __future__ import annotations

import torch


def reference_token_weights(loss_mask_S: torch.Tensor, traj_index_S: torch.Tensor, num_trajectories: int,
                            aggregation: str) -> torch.Tensor:
    """Per-position weights w_s `[S]` (float64) such that sum_s w_s * l_s is the configured aggregation over the
    given positions, computed over the WHOLE step at once: the reference for `models.microbatch.token_weights`,
    which computes a microbatch's share from the step's counts."""
    mask = loss_mask_S.to(torch.float64)
    if aggregation == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    per_traj = torch.zeros(num_trajectories, dtype=torch.float64, device=mask.device).index_add_(0, traj_index_S, mask)
    trained = (per_traj > 0).sum().clamp(min=1)
    return mask / per_traj[traj_index_S].clamp(min=1.0) / trained
