"""Policy objectives over per-token log-probabilities and their metadata, unaware of trees (HARTS eq. 18).

Legend: S semantic positions of one microbatch (original order). Every function sums over the positions it is given
and divides by an explicit `normalizer` supplied by the caller, so that the losses of all microbatches (and all
data-parallel ranks) of one optimizer step add up to the loss of the whole step: the caller computes the normalizer
once per step (e.g. the number of trained tokens of the step for token-level averaging, as DAPO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["PolicyLossConfig", "policy_loss", "LossTerms"]


@dataclass(kw_only=True)
class PolicyLossConfig:
    objective: Literal["grpo", "ppo"] = "grpo"
    """"grpo": clipped surrogate with group-relative advantages (computed by app.advantages); "ppo": the same
    clipped surrogate with externally given advantages. The surrogate itself is identical."""
    clip_low: float = 0.2
    """Ratio clip below 1 (PPO epsilon)."""
    clip_high: float = 0.28
    """Ratio clip above 1 (DAPO's clip-higher; set equal to clip_low for symmetric PPO)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """"token-mean": every trained token of the step weighs the same (DAPO); "seq-mean-token-mean": mean over each
    trajectory's trained tokens, then mean over trajectories (original GRPO)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL estimator to the reference policy (needs reference log-probs); 0 = off."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling for the rollout engine vs trainer mismatch: each token's loss is weighted by
    min(exp(old_logprob - rollout_logprob), tis_cap). None = off."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(
                f"`clip_low` must lie in [0, 1) and `clip_high` >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"`kl_coef` must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"`tis_cap` must be > 0 or unset, got {self.tis_cap}")


@dataclass
class LossTerms:
    """The loss and its parts (each already divided by the normalizer), plus detached diagnostics."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    tis_mean: torch.Tensor


def policy_loss(
    logprobs_S: torch.Tensor,
    old_logprobs_S: torch.Tensor,
    advantages_S: torch.Tensor,
    token_weight_S: torch.Tensor,
    config: PolicyLossConfig,
    rollout_logprobs_S: torch.Tensor | None = None,
    ref_logprobs_S: torch.Tensor | None = None,
) -> LossTerms:
    """Clipped policy-gradient loss with optional KL and truncated importance sampling.

    Args:
        logprobs_S: [S] current log-probabilities (in the graph).
        old_logprobs_S: [S] log-probabilities of the policy that the ratio is taken against (the trainer's
            pre-update policy; for a single update per batch, `logprobs_S.detach()`).
        advantages_S: [S] per-token advantages.
        token_weight_S: [S] per-token weights, zero on untrained positions (`models.microbatch.token_weights`:
            the step's normaliser times the trajectory weights).
        rollout_logprobs_S: [S] behaviour log-probabilities from the rollout engine (for truncated IS).
        ref_logprobs_S: [S] reference-policy log-probabilities (for the KL term).
    """
    w = token_weight_S.to(logprobs_S.dtype)
    active = w != 0
    log_ratio = logprobs_S - old_logprobs_S
    ratio = torch.exp(log_ratio)
    adv = advantages_S.to(logprobs_S.dtype)
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    is_weight = torch.ones_like(logprobs_S)
    if config.tis_cap is not None and rollout_logprobs_S is not None:
        log_ratio_S = old_logprobs_S.detach() - rollout_logprobs_S.to(logprobs_S.dtype)
        is_weight = torch.exp(log_ratio_S).clamp(max=config.tis_cap)
    policy = -(w * is_weight * surrogate).sum()
    kl = torch.zeros((), dtype=logprobs_S.dtype, device=logprobs_S.device)
    if config.kl_coef > 0:
        if ref_logprobs_S is None:
            raise ValueError("`kl_coef` > 0 needs reference log-probs: set ref_logprobs on the trajectories")
        delta = ref_logprobs_S.to(logprobs_S.dtype) - logprobs_S
        kl = (w * (torch.exp(delta) - delta - 1.0)).sum()
    loss = policy + config.kl_coef * kl
    with torch.no_grad():
        n = active.sum().clamp(min=1)
        clip_fraction = ((clipped != ratio) & active).sum() / n
        tis_mean = (is_weight * active).sum() / n
    return LossTerms(loss=loss, policy=policy, kl=kl, clip_fraction=clip_fraction, tis_mean=tis_mean)
