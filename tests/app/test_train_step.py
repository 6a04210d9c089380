"""The tree-executed, microbatched training step equals the trajectory-wise step on the whole batch (float64).

Reference: every trajectory through the model's flat forward separately (no trie, no plan), log-softmax of
logits / temperature, tests.reference.reference_token_weights over all positions of the step, one policy_loss, one
backward. Tested: the step loss and every parameter gradient after gradient accumulation over several planned
microbatches (parallel.replica.prepare_step + parallel.plain_runner.PlainRunner.train_step, the path of every
rank), with KL, truncated IS, both aggregations and a sampling temperature; `PlainRunner.score` against the same
reference; non-finite losses and skipped optimizer steps (app.train_step.optimizer_step).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from app.losses import RouterLossConfig, rl_loss
from app.objectives import PolicyLossConfig, policy_loss
from app.train_step import optimizer_step
from bench.branching import nested_fork_trajectories
from models.config import GDNConfig
from models.decoder import HybridForCausalLM
from models.presets import preset
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.microbatch.plan import plan_microbatches
from tests.reference import reference_token_weights

CHUNK = 16
#: float64 on both sides: only summation order differs.
TOL = 1e-9


def small_model(seed: int = 0) -> HybridForCausalLM:
    c = preset("tiny-qwen3-next")
    assert isinstance(c.linear_attention, GDNConfig)
    config = dataclasses.replace(
        c, vocab_size=64, hidden_size=32, dtype="float64",
        linear_attention=dataclasses.replace(c.linear_attention, num_k_heads=2, num_v_heads=4, head_k_dim=8,
                                             head_v_dim=8, chunk_size=CHUNK),
        full_attention=dataclasses.replace(c.full_attention, num_heads=4, num_kv_heads=2, head_dim=16),
        moe=dataclasses.replace(c.moe, num_experts=4, top_k=2, expert_intermediate_size=16,
                                shared_expert_intermediate_size=16),
        dense_ffn=dataclasses.replace(c.dense_ffn, intermediate_size=48),
    )
    torch.manual_seed(seed)
    return HybridForCausalLM(config)


def step_trajectories(seed: int = 0):
    rng = np.random.default_rng(seed)
    trajectories = nested_fork_trajectories(rng, CHUNK, 64, depth=3, trees=2)
    for t in trajectories:
        t.logprobs = -rng.uniform(0.5, 3.0, size=len(t))
        t.ref_logprobs = -rng.uniform(0.5, 3.0, size=len(t))
        t.weight = float(rng.uniform(0.5, 1.5))
    return trajectories


def plan_step(trajectories, model, capacity: int, aggregation: str = "token-mean"):
    plan = plan_microbatches(trajectories, capacity, 1)
    return prepare_step(trajectories, plan, dp_rank=0, dp_group=None, model_config=model.config,
                        aggregation=aggregation, device=torch.device("cpu"))


def flat_step(model, trajectories, config: PolicyLossConfig, temperature: float):
    """Loss and log-probs [S] of the whole step, trajectory by trajectory (original order)."""
    logprobs = []
    for t in trajectories:
        ids = torch.as_tensor(t.tokens)
        logits = model.flat_forward(ids).logits / temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
        logprobs.append(torch.cat([lp.new_zeros(1), lp]))
    logprobs_S = torch.cat(logprobs)
    cat = lambda name: torch.as_tensor(np.concatenate([getattr(t, name) for t in trajectories]))  # noqa: E731
    mask = cat("loss_mask").clone()
    starts = np.cumsum([0] + [len(t) for t in trajectories[:-1]])
    mask[starts] = False
    traj_index = torch.as_tensor(np.repeat(np.arange(len(trajectories)), [len(t) for t in trajectories]))
    weights = reference_token_weights(mask, traj_index, len(trajectories), config.aggregation)
    weights = weights * torch.as_tensor([t.weight for t in trajectories], dtype=torch.float64)[traj_index]
    terms = policy_loss(logprobs_S, logprobs_S.detach(), cat("advantage"), weights, config,
                        rollout_logprobs_S=cat("logprobs"), ref_logprobs_S=cat("ref_logprobs"))
    return terms.loss, logprobs_S


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_microbatched_tree_step_equals_flat_full_batch(aggregation):
    config = PolicyLossConfig(aggregation=aggregation, kl_coef=0.1, tis_cap=1.5)
    temperature = 0.7
    trajectories = step_trajectories()
    reference, tree = small_model(), small_model()

    loss, flat_logprobs = flat_step(reference, trajectories, config, temperature)
    loss.backward()

    mbs = plan_step(trajectories, tree, 160, aggregation)
    assert len(mbs) >= 3, "the step must be split for gradient accumulation to matter"
    runner = PlainRunner(tree)
    result = runner.train_step(mbs, rl_loss(config, RouterLossConfig()), temperature=temperature, entropy=True)
    assert result.non_finite is None
    assert abs(result.loss - loss.item()) <= TOL * max(1.0, abs(loss.item()))
    for (name, p_ref), p_tree in zip(reference.named_parameters(), tree.parameters()):
        scale = p_ref.grad.abs().max().item() + 1e-12
        err = (p_ref.grad - p_tree.grad).abs().max().item()
        assert err <= TOL * max(scale, 1.0), f"{name}: max abs diff {err:.3e} (grad scale {scale:.3e})"

    # score() returns the same log-probs as the flat forward, per microbatch in its own trajectory order.
    offsets = np.cumsum([0] + [len(t) for t in trajectories])
    index = {id(t): i for i, t in enumerate(trajectories)}
    for mb, scored in zip(mbs, runner.score(mbs, temperature=temperature)):
        expected = torch.cat([flat_logprobs[offsets[index[id(t)]]:offsets[index[id(t)] + 1]]
                              for t in mb.batches[0].trajectories])
        torch.testing.assert_close(scored, expected.detach(), rtol=0, atol=1e-10)


def test_step_plan_covers_the_step_once():
    trajectories = step_trajectories()
    mbs = plan_step(trajectories, small_model(), 10_000)
    assert sum(mb.batches[0].num_semantic for mb in mbs) == sum(len(t) for t in trajectories)
    assert sum(mb.batches[0].num_compact for mb in mbs) < sum(len(t) for t in trajectories)
    assert sum(mb.loss.token_share for mb in mbs) == pytest.approx(1.0)
    assert sorted(id(t) for mb in mbs for t in mb.batches[0].trajectories) == sorted(map(id, trajectories))


def test_non_finite_loss_and_gradients_are_not_applied():
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trajectories = step_trajectories()
    trajectories[3].advantage[:] = np.nan
    mbs = plan_step(trajectories, model, 160)
    bad = next(i for i, mb in enumerate(mbs) if trajectories[3] in mb.batches[0].trajectories)
    runner = PlainRunner(model)
    result = runner.train_step(mbs, rl_loss(PolicyLossConfig(), RouterLossConfig()), entropy=True)
    assert result.non_finite == bad and not np.isfinite(result.loss)

    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    norm, stepped = optimizer_step(runner, optimizer, grad_clip=1.0)
    assert not stepped and not np.isfinite(norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
