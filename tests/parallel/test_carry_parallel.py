"""Prefix carry on 2 CPU ranks (gloo) equals one process: FSDP2 (with activation recomputation), TP and EP. Each
DP replica runs the parts of its own trees (one part per microbatch, empty events padding the shorter replica); the
summed step loss and every parameter gradient match the whole step packed as one batch on the plain model
(`tests.parallel.harness.reference_step`, float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from app.objectives import PolicyLossConfig, policy_loss
from models.carry_microbatch import prepare_carry_step
from models.decoder import HybridForCausalLM
from models.microbatch import StepNormalizer, trained_counts
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job
from parallel.metrics import reduce_step
from parallel.plain_runner import PlainRunner
from tests.models.tree.test_carry_microbatch_layout import carry_parts
from tests.parallel.harness import TOLERANCES, reference_step, run_ranks, small_config, step_trajectories, z_loss


def carry_parallel_step(preset_name: str, parallel: dict, activation_checkpointing: str) -> None:
    job = init_distributed(ParallelConfig(activation_checkpointing=activation_checkpointing, **parallel), "cpu")
    config = small_config(preset_name)
    tol = TOLERANCES["float64"]
    torch.manual_seed(0)
    reference = HybridForCausalLM(config)
    model = copy.deepcopy(reference)
    loss_config = PolicyLossConfig()
    trajectories = step_trajectories(config, trees=2)
    ref_loss, ref_grads, _ = reference_step(reference, trajectories, loss_config)

    trees = [[t for t in trajectories if t.tree == name] for name in dict.fromkeys(t.tree for t in trajectories)]
    # Replica r runs trees r, r + D, ..., one part per microbatch; a shorter replica pads with empty events.
    D = job.config.dp
    per_replica = [[[p] for mb in carry_parts(trees[r::D], config.chunk_size) for p in mb] for r in range(D)]
    K = max(map(len, per_replica))
    mine = per_replica[job.dp_rank]
    pad = [-1] * (K - len(mine))
    events = [("forward", m) for m in [*range(len(mine)), *pad]] + [
        ("backward", m) for m in [*pad, *reversed(range(len(mine)))]]
    normalizer = StepNormalizer(*trained_counts(trajectories))
    step = prepare_carry_step(trees[job.dp_rank::D], mine, config, job.device, events=events, normalizer=normalizer)
    assert len(step) >= 3 and (D == 1 or len({len(parts) for parts in per_replica}) == 2), "one replica must pad"

    parallelize_for_job(model, job)
    dp_group = job.meshes.dp.get_group()
    semantic_tokens = sum(len(t) for t in trajectories)

    def loss_fn(lp, mb, output):
        terms = policy_loss(lp, lp.detach(), mb.loss.advantage, mb.loss.token_weight, loss_config)
        return terms.loss + z_loss(output, semantic_tokens), {"policy": terms.policy}

    metrics = PlainRunner(model, dp_group=dp_group).train_step(step, loss_fn)
    total = reduce_step(metrics, dp_group)
    assert total["semantic_tokens"] == semantic_tokens
    loss_err = abs(total["loss"] - ref_loss) / abs(ref_loss)
    assert loss_err <= tol["loss"], (total["loss"], ref_loss)
    worst, worst_name = 0.0, None
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = ((grad - ref_grads[name]).norm() / (ref_grads[name].norm() + 1e-300)).item()
        if err > worst:
            worst, worst_name = err, name
    if dist.get_rank() == 0:
        print(f"carry {parallel} {activation_checkpointing} {preset_name}: loss rel err {loss_err:.1e}, worst gradient "
              f"{worst_name} {worst:.1e}")
    assert worst <= tol["grad_rtol"], (worst_name, worst)


@pytest.mark.parametrize("preset_name, parallel, activation_checkpointing", [
    ("tiny-qwen3-next", {}, "full"),
    ("tiny-kimi-linear", {"tp": 2}, "none"),
    ("tiny-qwen3-next", {"ep": 2}, "full"),
])
def test_carry_parallel_step_matches_single_process(preset_name, parallel, activation_checkpointing):
    run_ranks(2, carry_parallel_step, preset_name, parallel, activation_checkpointing)
