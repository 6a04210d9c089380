"""Pipeline parallelism (parallel.pipeline, torch >= 2.14) on gloo CPU ranks: the pipelined step gives the
single-process loss, every parameter gradient and the expert loads of the whole step packed as one batch, and the
single-process log-probs (scored at a temperature) and entropies, with the planner's microbatches (of different
compact row counts) and activation recomputation, through parallel.pipeline_runner.PipelineRunner (the reference
scores come from parallel.plain_runner.PlainRunner on the unsplit model), which refuses a carry step; below torch
2.14, pp > 1 is refused with the reason."""

import pytest
import torch
import torch.distributed as dist

from app.objectives import PolicyLossConfig, policy_loss
from models.decoder import HybridForCausalLM
from models.presets import preset
from models.step import Step
from models.tree.mixers import TreeContext
from parallel.config import ParallelConfig, pipeline_support
from parallel.launch import init_distributed
from parallel.metrics import global_expert_counts, reduce_step
from parallel.pipeline import pipeline_for_job, stage_layers
from parallel.pipeline_runner import PipelineRunner
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.microbatch.plan import plan_microbatches
from planner.step_plan import plan_step
from tests.parallel.harness import TOLERANCES, reference_step, run_ranks, small_config, step_trajectories, z_loss


def compare_pipeline(preset_name: str, parallel: dict, capacity: int, trees: int, dtype: str) -> None:
    """Run in every rank: the pipelined step == the single-process step (loss, gradients, expert loads, scores)."""
    job = init_distributed(ParallelConfig(activation_checkpointing="full", **parallel), "cpu")
    config = small_config(preset_name, dtype=dtype)
    tol = TOLERANCES[dtype]
    torch.manual_seed(0)
    model = HybridForCausalLM(config)
    loss_config = PolicyLossConfig()
    trajectories = step_trajectories(config, trees)
    plan = plan_microbatches(trajectories, capacity, job.config.dp)
    dp_group = job.meshes.dp.get_group()
    mbs = prepare_step(trajectories, plan, dp_rank=job.dp_rank, dp_group=dp_group, model_config=config,
                       aggregation=loss_config.aggregation, device=job.device)
    ref_scores = PlainRunner(model).score(mbs, temperature=0.7)
    with torch.no_grad():
        ref_entropy = [model(TreeContext(mb.layout), entropy=True).entropy for mb in mbs]
    reference = HybridForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    ref_loss, ref_grads, ref_counts = reference_step(reference, trajectories, loss_config)

    pipelined = pipeline_for_job(model, job)
    del model
    runner = PipelineRunner(pipelined, dp_group=dp_group)
    S = sum(len(t) for t in trajectories)

    def loss_fn(lp, mb, output):
        assert any(mb is m for m in mbs), "the loss must get the microbatch itself"
        want = ref_entropy[next(i for i, m in enumerate(mbs) if m is mb)]
        assert (output.entropy - want).abs().max() <= tol["loss"] * want.abs().max(), "entropies"
        terms = policy_loss(lp, lp.detach(), mb.loss.advantage, mb.loss.token_weight, loss_config)
        return terms.loss + z_loss(output, S), {"policy": terms.policy}

    rows = {mb.num_compact for mb in mbs}
    assert len(mbs) >= 2 and len(rows) > 1, f"want microbatches of different row counts, got {len(mbs)}: {rows}"
    scores = runner.score(mbs, temperature=0.7)
    for got, want in zip(scores, ref_scores, strict=True):
        assert (got - want).abs().max() <= tol["loss"] * want.abs().max(), "scored log-probs"
    assert sorted(runner.decoder_layers()) == [i for s in pipelined.stage_indices for i in pipelined.stage_layers[s]]
    total_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
    worst = 0.0
    # a second step (new schedule, gradients zeroed as by the optimizer) gives the same again
    for _ in range(2):
        for p in pipelined.parameters():
            p.grad = None
        metrics = runner.train_step(mbs, loss_fn, entropy=True)
        step = reduce_step(metrics, dp_group)
        assert step["microbatches"] == len(plan.microbatches) and step["semantic_tokens"] == S
        assert metrics.non_finite is None and metrics.extras.keys() == {"policy"}
        for got, want in zip(global_expert_counts(metrics, dp_group), ref_counts, strict=True):
            assert (got is None and want is None) or torch.equal(got, want), "expert loads differ from one process"
        loss_err = abs(step["loss"] - ref_loss) / abs(ref_loss)
        assert loss_err <= tol["loss"], f"step loss {step['loss']} vs one process {ref_loss} (rel err {loss_err:.2e})"
        for name, p in pipelined.named_parameters():
            grad = p.grad.full_tensor()
            ref = ref_grads[name]
            err = ((grad - ref).norm() / (tol["grad_rtol"] * ref.norm() + tol["grad_floor"] * total_norm)).item()
            assert err <= 1.0, f"gradient of {name} differs by {err:.2f} x the tolerance {tol}"
            worst = max(worst, err)
    names = [None] * pipelined.parallel.pp
    dist.all_gather_object(names, [n for n, _ in pipelined.named_parameters()], group=pipelined.pp_group)
    assert sorted(n for part in names for n in part) == sorted(ref_grads), "stages must hold every parameter once"
    norm = runner.clip_grad_norm_(0.5 * total_norm).item()
    assert abs(norm - total_norm) <= tol["grad_rtol"] * total_norm, (norm, total_norm)
    if dist.get_rank() == 0:
        print(f"{preset_name} {dtype} {parallel}: loss rel err {loss_err:.1e}, worst gradient at {worst:.1e} of its "
              f"tolerance, rows per microbatch {sorted(rows)}")
    if parallel.get("pp_schedule", "1F1B") == "1F1B":
        too_few = PipelineRunner(pipelined)
        one = Step.self_contained(mbs.microbatches[:1])
        with pytest.raises(ValueError, match="1F1B schedule needs at least `parallel.pp`"):
            too_few.train_step(one, loss_fn)
        with pytest.raises(ValueError, match="1F1B schedule needs at least `parallel.pp`"):
            too_few.score(one)
    carried = prepare_step(trajectories, plan_step(trajectories, capacity, job.config.dp, "carry"),
                           dp_rank=job.dp_rank, dp_group=None, model_config=config,
                           aggregation=loss_config.aggregation, device=job.device)
    with pytest.raises(NotImplementedError, match="carry context"):
        runner.train_step(carried, loss_fn)


@pytest.mark.pipeline
def test_pp2_kimi_linear_1f1b_float64():
    run_ranks(2, compare_pipeline, "tiny-kimi-linear", {"pp": 2}, 192, 1, "float64")


@pytest.mark.pipeline
def test_pp2_interleaved_qwen3_next_float32():
    run_ranks(2, compare_pipeline, "tiny-qwen3-next", {"pp": 2, "pp_schedule": "Interleaved1F1B"}, 192, 1, "float32")


@pytest.mark.pipeline
def test_pp2_x_fsdp2_qwen3_next_float64():
    run_ranks(4, compare_pipeline, "tiny-qwen3-next", {"pp": 2, "dp_shard": 2}, 192, 2, "float64")


def test_stage_layers_follow_torchtitan_split():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(4, 4) == [range(0, 1), range(1, 3), range(3, 4), range(4, 4)]


@pytest.mark.pipeline
@pytest.mark.parametrize(
    "degrees, model, error, match",
    [
        ({"pp": 2}, "tiny-qwen3-next", NotImplementedError, "parallelize_hybrid does not split"),
        ({"pp": 2, "tp": 2}, "tiny-qwen3-next", NotImplementedError, "use tp = ep = 1 with pp > 1"),
        ({"pp": 4, "pp_schedule": "Interleaved1F1B"}, "tiny-kimi-linear", ValueError, "makes 8 stages"),
    ],
    ids=["not-pipelined", "pp-and-tp", "too-many-stages"],
)
def test_pipeline_validation(degrees, model, error, match):
    config = ParallelConfig(**degrees).resolved(degrees["pp"] * degrees.get("tp", 1))
    with pytest.raises(error, match=match):
        config.validate(preset(model), pipelined="tp" in degrees or degrees["pp"] == 4)
    with pytest.raises(ValueError, match="`parallel.pp_schedule` must be one of"):
        ParallelConfig(pp=2, pp_schedule="ZBV")


@pytest.mark.skipif(pipeline_support() is None, reason="torch >= 2.14 runs pipeline parallelism")
def test_pp_refused_below_torch_2_14():
    config = ParallelConfig(pp=2).resolved(2)
    with pytest.raises(NotImplementedError, match=r"`parallel.pp` = 2: torch .* pipeline parallelism needs torch >= "
                                                  r"2\.14; set pp = 1"):
        config.validate(preset("tiny-qwen3-next"), pipelined=True)
