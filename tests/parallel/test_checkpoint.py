"""torchtitan DCP checkpoints of a parallelized model on 2 CPU ranks (gloo): train one step under FSDP2 + EP,
save (model, AdamW state, lr schedule, train state), then resume under a different layout (FSDP2 + TP over the same
2 ranks, a fresh model from another seed); DCP reshards, and parameters and optimizer state come back exactly."""

import torch
import torch.distributed as dist

from models.decoder import HybridForCausalLM
from parallel.checkpoint import TrainState, build_checkpointer, build_lr_schedulers, build_optimizers
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_replica
from planner.microbatch import plan_microbatches
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
        schedulers = build_lr_schedulers(optimizers, warmup_steps=2, training_steps=10)
        state = TrainState()
        return job, model, optimizers, schedulers, state, build_checkpointer(
            model, optimizers, schedulers, state, folder=folder, interval=1)

    job, model, optimizers, schedulers, state, checkpointer = build({"ep": 2}, seed=0)
    assert not checkpointer.load()  # empty folder: a fresh start
    trajectories = step_trajectories(config, trees=1)
    dp_group = job.meshes.dp.get_group()
    mine = prepare_replica(trajectories, plan_microbatches(trajectories, 192, job.config.dp), dp_rank=job.dp_rank,
                           dp_group=dp_group, model_config=config, aggregation="token-mean", device=job.device)
    PlainRunner(model, dp_group=dp_group).train_step(mine, lambda lp, mb, out: (lp.sum() * 1e-3, {}))
    optimizers.step()
    schedulers.step()
    state.step = 1
    assert checkpointer.save(1)
    saved = {n: full(p).clone() for n, p in model.named_parameters()}
    saved_optimizer = flat_optimizer_state(optimizers)
    lr = schedulers.get_metrics()

    _, model2, optimizers2, schedulers2, state2, checkpointer2 = build({"tp": 2}, seed=1)
    assert checkpointer2.load()
    assert state2.step == 1 and schedulers2.get_metrics() == lr
    assert_restored(model2, optimizers2, saved, saved_optimizer)
    checkpointer.close()
    checkpointer2.close()
    dist.barrier()


def test_dcp_save_and_resume_under_another_layout(tmp_path):
    run_ranks(2, save_then_resume_resharded, str(tmp_path / "checkpoints"))
