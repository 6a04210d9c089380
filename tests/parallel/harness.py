"""Multi-process CPU (gloo) runs of a parallelized step against the single-process step (shared by the tests).

`run_ranks(n, fn, *args)` starts n processes with torchrun's environment variables and runs `fn(*args)` in each;
an exception in any rank fails the test with that rank's traceback.

`compare_step(...)`, run in every rank: build the same small model on every rank (same seed), compute the reference
in-process on the plain model (the whole step packed as ONE batch, tests.reference.reference_token_weights over all
positions), then parallelize a copy, plan the step's microbatches (planner.microbatch.plan, capacity = compact rows per
microbatch), prepare this replica's step (`parallel.replica.prepare_step`), run it with
`parallel.plain_runner.PlainRunner`, and compare the summed loss
and every parameter gradient (gathered with DTensor.full_tensor) with the reference.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.objectives import PolicyLossConfig, policy_loss
from bench.branching import nested_fork_trajectories
from models.config import GDNConfig
from models.decoder import HybridForCausalLM
from models.presets import preset
from models.tree.layout import TreeLayout
from models.tree.mixers import TreeContext
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job
from parallel.metrics import global_expert_counts, reduce_step
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.calls.plan import plan_calls
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack
from tests.reference import reference_token_weights

#: Tolerances per dtype: relative error of the step loss; per parameter, the gradient error norm may reach
#: rtol * |reference| + floor * |all reference gradients|. The floor matters in fp32 only: splitting the step into
#: microbatches alone (one process, no parallelism) moves gradients whose norm is ~1e-8 of the total (deep linear-
#: attention decays: cancellation) by ~2% of themselves.
TOLERANCES = {
    "float64": {"loss": 1e-10, "grad_rtol": 1e-8, "grad_floor": 0.0},
    "float32": {"loss": 1e-5, "grad_rtol": 1e-4, "grad_floor": 1e-6},
}
Z_LOSS_COEF = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        fn(*args)
        if dist.is_initialized():
            # No rank tears its gloo group down while a peer still uses it: in one full-suite run on 2 busy cores a
            # rank aborted in teardown ("terminate called without an active exception") after its step had passed.
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> None:
    mp.spawn(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)


def small_config(name: str, num_experts: int = 4, dtype: str = "float64"):
    """The preset's architecture at test size (as tests/models/tree/test_execute.py), small chunks."""
    c = preset(name)
    if isinstance(c.linear_attention, GDNConfig):
        lin = dataclasses.replace(c.linear_attention, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                                  chunk_size=16)
        full = dataclasses.replace(c.full_attention, num_heads=4, num_kv_heads=2, head_dim=16)
    else:
        lin = dataclasses.replace(c.linear_attention, num_heads=2, head_dim=8, chunk_size=32)
        full = dataclasses.replace(c.full_attention, num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                   qk_rope_head_dim=8, v_head_dim=8)
    moe = dataclasses.replace(c.moe, num_experts=num_experts, top_k=2, expert_intermediate_size=16,
                              shared_expert_intermediate_size=16)
    return dataclasses.replace(
        c, vocab_size=64, hidden_size=32, linear_attention=lin, full_attention=full, moe=moe,
        dense_ffn=dataclasses.replace(c.dense_ffn, intermediate_size=48), dtype=dtype,
    )


def step_trajectories(model_config, trees: int, seed: int = 0):
    chunk = model_config.linear_attention.chunk_size
    return nested_fork_trajectories(np.random.default_rng(seed), chunk, model_config.vocab_size, depth=3, trees=trees)


def z_loss(output, semantic_tokens: int):
    """Router z-loss of the step: sum of the multiplicity-weighted z sums over the step's semantic tokens (linear in
    the per-microbatch sums, so it adds over microbatches and replicas)."""
    z = [s.z_sum for s in output.moe_stats if s is not None]
    return Z_LOSS_COEF * torch.stack(z).sum() / semantic_tokens


def reference_step(model, trajectories, loss_config):
    """Loss and gradients of the whole step as one packed batch on a plain model."""
    batch = pack(trajectories)
    chunk = model.config.linear_attention.chunk_size
    layout = TreeLayout.build(batch, plan_calls(batch, chunk), model.config.linear_attention.conv_size)
    out = model(TreeContext(layout))
    lp = out.logprobs
    w = reference_token_weights(torch.as_tensor(batch.loss_mask), torch.as_tensor(batch.traj_index),
                                batch.num_trajectories, loss_config.aggregation) * torch.as_tensor(batch.weight)
    terms = policy_loss(lp, lp.detach(), torch.as_tensor(batch.advantage), w, loss_config)
    loss = terms.loss + z_loss(out, batch.num_semantic)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, [None if s is None else s.expert_counts for s in out.moe_stats]


def compare_step(preset_name: str, parallel: dict, capacity: int, trees: int,
                 activation_checkpointing: str = "none", num_experts: int = 4,
                 aggregation: str = "token-mean", dtype: str = "float64") -> None:
    """Run in every rank: parallel step == single-process step (loss and all gradients, `TOLERANCES[dtype]`)."""
    job = init_distributed(ParallelConfig(activation_checkpointing=activation_checkpointing, **parallel), "cpu")
    config = small_config(preset_name, num_experts, dtype)
    tol = TOLERANCES[dtype]
    torch.manual_seed(0)
    reference = HybridForCausalLM(config)
    model = copy.deepcopy(reference)
    loss_config = PolicyLossConfig(aggregation=aggregation)
    trajectories = step_trajectories(config, trees)
    ref_loss, ref_grads, ref_counts = reference_step(reference, trajectories, loss_config)

    parallelize_for_job(model, job)
    plan = plan_microbatches(trajectories, capacity, job.config.dp)
    dp_group = job.meshes.dp.get_group()
    mine = prepare_step(trajectories, plan, dp_rank=job.dp_rank, dp_group=dp_group, model_config=config,
                        aggregation=aggregation, device=job.device)
    semantic_tokens = sum(len(t) for t in trajectories)

    def loss_fn(lp, mb, output):
        terms = policy_loss(lp, lp.detach(), mb.loss.advantage, mb.loss.token_weight, loss_config)
        return terms.loss + z_loss(output, semantic_tokens), {"policy": terms.policy}

    runner = PlainRunner(model, dp_group=dp_group)
    metrics = runner.train_step(mine, loss_fn)
    step = reduce_step(metrics, dp_group)
    assert step["microbatches"] == len(plan.microbatches) and step["semantic_tokens"] == semantic_tokens
    for got, want in zip(global_expert_counts(metrics, dp_group), ref_counts):
        assert (got is None and want is None) or torch.equal(got, want), "expert loads differ from one process"
    loss_err = abs(step["loss"] - ref_loss) / abs(ref_loss)
    assert loss_err <= tol["loss"], f"step loss {step['loss']} vs single-process {ref_loss} (rel err {loss_err:.2e})"
    total_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
    worst, worst_name = 0.0, None
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ref = ref_grads[name]
        # Error in units of the allowed error: <= 1 passes.
        err = ((grad - ref).norm() / (tol["grad_rtol"] * ref.norm() + tol["grad_floor"] * total_norm + 1e-300)).item()
        if err > worst:
            worst, worst_name = err, name
    if dist.get_rank() == 0:
        print(f"{preset_name} {dtype} {parallel}: loss rel err {loss_err:.1e}; worst gradient {worst_name} at "
              f"{worst:.1e} of its tolerance")
    assert worst <= 1.0, f"gradient of {worst_name} differs by {worst:.2f} x the tolerance {tol}"
    # Clipping to half the norm: the global norm over all meshes is the reference's, and every gradient (here the
    # routed experts', on the expert mesh under EP) scales by max_norm / (norm + 1e-6).
    norm = runner.clip_grad_norm_(0.5 * total_norm).item()
    assert abs(norm - total_norm) <= tol["grad_rtol"] * total_norm, (norm, total_norm)
    coef = 0.5 * total_norm / (norm + 1e-6)
    name, p = next((n, p) for n, p in model.named_parameters() if "experts" in n)
    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    bound = 2 * tol["grad_rtol"] * ref_grads[name].norm() + tol["grad_floor"] * total_norm
    assert (grad - coef * ref_grads[name]).norm() <= bound, f"clipped gradient of {name}"
