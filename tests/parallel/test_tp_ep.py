"""Tensor parallelism together with expert parallelism on 4 CPU ranks (gloo), float64, torchtitan 0.3.0's layout:
dp_shard 2 x tp 2, expert-parallel groups taken from those 4 ranks (efsdp x ep). In MoE layers each tp rank routes
its slice of the replica's compact rows, routed experts run whole on their ep rank (ETP = 1), the shared expert is
width-sharded over tp. The step's loss and every gradient equal the single-process step's; a DCP checkpoint saved
under one tp x ep layout resumes under another."""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from models.decoder import HybridForCausalLM
from models.presets import preset
from models.tree.layout import TreeLayout
from models.tree.mixers import TreeContext
from parallel.checkpoint import TrainingState, build_optimizers, save_tensors
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job
from planner.calls.plan import plan_calls
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.parallel.harness import compare_step, run_ranks, small_config
from tests.parallel.test_checkpoint import assert_restored, flat_optimizer_state, full


def test_validate_accepts_tp_with_ep_and_names_the_ep_divisor():
    ParallelConfig(tp=2, ep=4).resolved(4).validate(preset("tiny-qwen3-next"))
    ParallelConfig(tp=4, ep=8).resolved(8).validate(preset("tiny-kimi-linear"))
    with pytest.raises(ValueError, match=r"`parallel.ep` \(4\) must divide `parallel.dp_shard` \(1\) \* `parallel.tp` "
                                         r"\(2\).*move ranks from dp_replicate to dp_shard"):
        ParallelConfig(dp_replicate=2, tp=2, ep=4).resolved(4).validate(preset("tiny-qwen3-next"))


def test_kimi_tp_ep2_step_with_recomputation_matches_single_process():
    """ep 2 = the tp pair of a replica, efsdp 2 (experts sharded over the replicas); KDA + MLA, sigmoid router with
    expert bias, ungated shared experts, a dense first layer, full-layer recomputation (the all-to-alls and tp
    reductions of the MoE layers run again in backward)."""
    run_ranks(4, compare_step, "tiny-kimi-linear", {"dp_shard": 2, "tp": 2, "ep": 2}, 192, 2, "full")


def test_qwen3_next_tp_ep4_step_one_row_microbatch_and_dcp_resume(tmp_path):
    """ep 4 = all ranks, efsdp 1; GDN + gated attention, softmax router, gated shared expert. In one launch (each
    4-rank launch costs ~20 s of CPU in imports): the step matches one process; a one-row microbatch matches one
    process; after an AdamW step the DCP checkpoint resumes under ep 2 (efsdp 2), parameters and AdamW state
    exactly."""
    run_ranks(4, qwen3_next_tp_ep4, str(tmp_path / "checkpoints"))


def qwen3_next_tp_ep4(folder):
    compare_step("tiny-qwen3-next", {"dp_shard": 2, "tp": 2, "ep": 4}, 192, 2)
    one_row_step_then_save_and_resume_under_another_layout(folder)


def one_row_step_then_save_and_resume_under_another_layout(folder):
    config = small_config("tiny-qwen3-next")

    def build(ep, seed):
        job = init_distributed(ParallelConfig(dp_shard=2, tp=2, ep=ep), "cpu")
        torch.manual_seed(seed)
        plain = HybridForCausalLM(config)
        model = parallelize_for_job(copy.deepcopy(plain), job)
        optimizers = build_optimizers(model, lr=1e-2, implementation="for-loop")
        return plain, model, optimizers, TrainingState(model, list(optimizers))

    plain, model, optimizers, state = build(ep=4, seed=0)
    fewer_rows_than_tp_ranks(model, plain, config)
    # A microbatch with targets, so that every parameter (the LM head too) has a gradient and AdamW state.
    lp = model(TreeContext(tree_layout(config, [5, 9, 11, 3]))).logprobs
    lp.sum().backward()
    optimizers.step()
    save_tensors(state.tensors(), folder)
    saved = {n: full(p).clone() for n, p in model.named_parameters()}
    saved_optimizer = flat_optimizer_state(optimizers)

    _, resumed, optimizers2, state2 = build(ep=2, seed=1)
    state2.load(folder)
    assert_restored(resumed, optimizers2, saved, saved_optimizer)
    dist.barrier()


def tree_layout(config, tokens: list[int]) -> TreeLayout:
    """The layout of a microbatch of one trajectory."""
    batch = pack([Trajectory(tokens=np.array(tokens), loss_mask=np.ones(len(tokens), dtype=bool))])
    return TreeLayout.build(batch, plan_calls(batch, config.linear_attention.chunk_size),
                            config.linear_attention.conv_size)


def fewer_rows_than_tp_ranks(model, reference, config):
    """Forward and backward of a microbatch of one compact row: tp rank 0 routes none, and with top-2 of 4 experts
    on 4 ep ranks at least two ranks receive no pairs (all still join the all-to-alls and FSDP2's reductions).
    Hidden states and every gradient equal the single-process model's (gradients summed over the 2 replicas, which
    run the same row)."""
    layout = tree_layout(config, [7])
    assert layout.row_weight.numel() == 1
    probe_D = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hidden = []
    for m in (reference, model):
        out = m(TreeContext(layout))
        z = torch.stack([s.z_sum for s in out.moe_stats if s is not None]).sum()
        ((out.hidden * probe_D).sum() + z).backward()
        hidden.append(out.hidden)
    torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-12, atol=1e-12)
    for (n, ref), p in zip(reference.named_parameters(), model.parameters()):
        want = torch.zeros_like(ref) if ref.grad is None else 2 * ref.grad  # None: the LM head (no target here)
        got = torch.zeros_like(ref) if p.grad is None else full(p.grad)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14, msg=n)
