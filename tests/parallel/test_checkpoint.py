"""DCP checkpoints of a parallelized model on 2 CPU ranks (gloo), parallel.checkpoint.TrainingState: train one step
under FSDP2 + EP, save (model, AdamW state), then resume under a different layout (FSDP2 + TP over the same 2 ranks,
a fresh model from another seed); DCP reshards, and parameters and optimizer state come back exactly. The optimizer
state is compared through torchtitan's own flat state dict (`OptimizersContainer.state_dict`), not ours."""

import torch
import torch.distributed as dist

from models.decoder import HybridForCausalLM
from parallel.checkpoint import TrainingState, build_optimizers, save_tensors
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.microbatch.plan import plan_microbatches
from tests.parallel.harness import run_ranks, small_config, step_trajectories


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def flat_optimizer_state(optimizers):
    return {k: full(v).clone() for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_restored(model, optimizers, saved, saved_optimizer):
    """Every parameter and every optimizer tensor equals the saved one bit for bit."""
    for n, p in model.named_parameters():
        assert torch.equal(full(p), saved[n]), n
    restored = flat_optimizer_state(optimizers)
    assert restored.keys() == saved_optimizer.keys() and len(restored) > 2 * len(saved)
    for k, v in restored.items():
        assert torch.equal(v, saved_optimizer[k]), k


def save_then_resume_resharded(folder):
    config = small_config("tiny-kimi-linear")

    def build(layout, seed):
        job = init_distributed(ParallelConfig(**layout), "cpu")
        torch.manual_seed(seed)
        model = parallelize_for_job(HybridForCausalLM(config), job)
        optimizers = build_optimizers(model, lr=1e-2, implementation="for-loop")
        return job, model, optimizers, TrainingState(model, list(optimizers))

    job, model, optimizers, state = build({"ep": 2}, seed=0)
    trajectories = step_trajectories(config, trees=1)
    dp_group = job.meshes.dp.get_group()
    mine = prepare_step(trajectories, plan_microbatches(trajectories, 192, job.config.dp), dp_rank=job.dp_rank,
                        dp_group=dp_group, model_config=config, aggregation="token-mean", device=job.device)
    PlainRunner(model, dp_group=dp_group).train_step(mine, lambda lp, mb, out: (lp.sum() * 1e-3, {}))
    optimizers.step()
    save_tensors(state.tensors(), folder)
    saved = {n: full(p).clone() for n, p in model.named_parameters()}
    saved_optimizer = flat_optimizer_state(optimizers)

    _, model2, optimizers2, state2 = build({"tp": 2}, seed=1)
    state2.load(folder)
    assert_restored(model2, optimizers2, saved, saved_optimizer)
    dist.barrier()


def test_dcp_save_and_resume_under_another_layout(tmp_path):
    run_ranks(2, save_then_resume_resharded, str(tmp_path / "checkpoint"))
