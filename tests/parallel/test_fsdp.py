"""FSDP2 over 2 CPU ranks (gloo): the planner-assigned microbatches of each replica give the single-process step's
loss and gradients (fp32), with activation recomputation; unequal microbatch counts are refused before any
collective could hang."""

import pytest

from models.microbatch import prepare_microbatch
from models.step import Step
from parallel.config import ParallelConfig
from parallel.launch import init_distributed
from parallel.plain_runner import PlainRunner
from tests.parallel.harness import compare_step, run_ranks, small_config, step_trajectories


def fsdp_then_unequal_counts():
    compare_step("tiny-qwen3-next", {}, capacity=128, trees=2, activation_checkpointing="full",
                 dtype="float32")
    # Same process group again (init_distributed reuses it): rank 0 gets one microbatch more than rank 1.
    job = init_distributed(ParallelConfig(), "cpu")
    from models.decoder import HybridForCausalLM

    model = HybridForCausalLM(small_config("tiny-qwen3-next"))
    trajectories = step_trajectories(model.config, trees=1)
    mine = [prepare_microbatch(g, model.config, job.device) for g in [trajectories[:2], trajectories[2:4]]]
    step = Step.self_contained(mine[: 2 - job.dp_rank])
    with pytest.raises(ValueError, match="every replica must run the same number"):
        PlainRunner(model, dp_group=job.meshes.dp.get_group()).train_step(step, lambda *a: None)


def test_fsdp_step_matches_single_process():
    run_ranks(2, fsdp_then_unequal_counts)
