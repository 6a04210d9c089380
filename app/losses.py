"""Microbatch losses for `parallel.runner.StepRunner.train_step`: SFT (token-mean NLL) and the RL policy loss, each
plus the MoE router losses. Every metric is a sum over the microbatch (the step adds them over microbatches and
replicas; means are sums / counts). A loss reads its inputs from the microbatch it is handed (`Microbatch.loss`).

Legend: S semantic positions of a microbatch (original order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.objectives import PolicyLossConfig, policy_loss
from models.decoder import DecoderOutput
from models.microbatch import LossInputs
from models.moe import load_balancing_loss, pooled_stats, router_z_loss
from parallel.runner import MicrobatchLoss

__all__ = ["RouterLossConfig", "router_loss", "sft_loss", "rl_loss"]


@dataclass(frozen=True)
class RouterLossConfig:
    aux_coef: float = 0.0
    z_coef: float = 0.0


def router_loss(mb: LossInputs, output: DecoderOutput, config: RouterLossConfig) -> torch.Tensor:
    """Load-balancing and z-loss of this microbatch's routers (all MoE layers pooled; rows weighted by their
    multiplicities), weighted by the microbatch's share of the step's tokens."""
    pooled = pooled_stats(output.moe_stats)
    zero = output.hidden.new_zeros((), dtype=torch.float32)
    if pooled is None or (config.aux_coef == 0 and config.z_coef == 0):
        return zero
    loss = config.aux_coef * load_balancing_loss(pooled) + config.z_coef * router_z_loss(pooled)
    return mb.token_share * loss


def _counts(mb: LossInputs, logprobs_S: torch.Tensor, entropy_S: torch.Tensor) -> dict[str, torch.Tensor]:
    trained = mb.trained.to(logprobs_S.dtype)
    return {
        "trained_tokens": trained.sum(),
        "entropy_sum": (entropy_S.detach() * trained).sum(),
        "nll_sum": -(logprobs_S.detach() * trained).sum(),
    }


def sft_loss(router: RouterLossConfig) -> MicrobatchLoss:
    """Negative log-likelihood of the trained (assistant) tokens under the step's normalisers (run with
    `train_step(..., entropy=True)`)."""

    def loss_fn(logprobs_S, microbatch, output):
        mb, entropy_S = microbatch.loss, output.entropy
        nll = -(mb.token_weight.to(logprobs_S.dtype) * logprobs_S).sum()
        aux = router_loss(mb, output, router)
        return nll + aux, {**_counts(mb, logprobs_S, entropy_S), "router_loss": aux.detach()}

    return loss_fn


def rl_loss(config: PolicyLossConfig, router: RouterLossConfig) -> MicrobatchLoss:
    """`app.objectives.policy_loss` (clipped surrogate, KL, truncated IS) plus router losses, with diagnostics: the
    trainer-vs-engine log-prob mismatch on trained tokens, clipping and IS-weight sums (run with
    `train_step(..., entropy=True)`)."""

    def loss_fn(logprobs_S, microbatch, output):
        mb, entropy_S = microbatch.loss, output.entropy
        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs_S.detach()
        terms = policy_loss(
            logprobs_S, old.to(logprobs_S.dtype), mb.advantage, mb.token_weight, config,
            rollout_logprobs_S=mb.rollout_logprobs, ref_logprobs_S=mb.ref_logprobs,
        )
        aux = router_loss(mb, output, router)
        metrics = _counts(mb, logprobs_S, entropy_S)
        n = metrics["trained_tokens"]
        metrics.update(
            policy=terms.policy.detach(), kl=terms.kl.detach(), router_loss=aux.detach(),
            clipped=terms.clip_fraction * n, tis_weight_sum=terms.tis_mean * n,
        )
        if mb.rollout_logprobs is not None:
            trained = mb.trained.to(torch.float64)
            delta = mb.rollout_logprobs - logprobs_S.detach().to(torch.float64)
            metrics["mismatch_abs_sum"] = (delta.abs() * trained).sum()
            metrics["mismatch_sum"] = (delta * trained).sum()
        return terms.loss + aux, metrics

    return loss_fn
