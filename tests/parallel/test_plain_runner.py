"""parallel.plain_runner in one process: the planner-driven microbatched step equals the whole step packed as one
batch (float64), and its metrics reduce; a HARTS step (no carry events) runs exactly as microbatch after microbatch
did, and a duplicate and a carry plan of the same batch go through the same entry point to the same gradients."""

import copy

import pytest
import torch

from app.objectives import PolicyLossConfig, policy_loss
from models.decoder import HybridForCausalLM
from models.step import Step
from models.tree.mixers import TreeContext
from parallel.metrics import reduce_step
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.microbatch.plan import plan_microbatches
from planner.replica_share import forward_backward_events
from planner.step_plan import plan_step
from tests.parallel.harness import TOLERANCES, reference_step, small_config, step_trajectories, z_loss


def test_single_process_step_matches_whole_batch(tmp_path):
    config = small_config("tiny-kimi-linear")
    torch.manual_seed(0)
    reference = HybridForCausalLM(config)
    model = copy.deepcopy(reference)
    model.set_activation_checkpointing(True)
    loss_config = PolicyLossConfig()
    trajectories = step_trajectories(config, trees=2)
    ref_loss, ref_grads, _ = reference_step(reference, trajectories, loss_config)
    microbatches = prepare_step(trajectories, plan_microbatches(trajectories, 192, dp=1), dp_rank=0,
                                dp_group=None, model_config=config, aggregation=loss_config.aggregation,
                                device=torch.device("cpu"))
    S = sum(len(t) for t in trajectories)

    def loss_fn(lp, mb, output):
        terms = policy_loss(lp, lp.detach(), mb.loss.advantage, mb.loss.token_weight, loss_config)
        return terms.loss + z_loss(output, S), {"clip_fraction": terms.clip_fraction}

    runner = PlainRunner(model)
    metrics = runner.train_step(microbatches, loss_fn)
    tol = TOLERANCES["float64"]
    assert len(microbatches) >= 3 and metrics.microbatches == len(microbatches)
    assert metrics.semantic_tokens == S and 0 < metrics.compact_rows < S
    assert abs(metrics.loss - ref_loss) <= tol["loss"] * abs(ref_loss)
    for name, p in model.named_parameters():
        assert (p.grad - ref_grads[name]).norm() <= tol["grad_rtol"] * ref_grads[name].norm(), name
    counts = [c for c in metrics.expert_counts if c is not None]
    assert len(counts) == 3 and all(float(c.sum()) == 2 * S for c in counts)  # top-2 of every semantic position
    assert sorted(runner.decoder_layers()) == list(range(config.num_layers))
    with pytest.raises(ValueError, match="`step` is empty"):
        runner.train_step(Step.self_contained([]), loss_fn)
    scalars = reduce_step(metrics, None)
    assert scalars["compression"] == S / metrics.compact_rows and scalars["clip_fraction"] >= 0


def _policy_loss(loss_config: PolicyLossConfig, semantic_tokens: int):
    def loss_fn(lp, mb, output):
        terms = policy_loss(lp, lp.detach(), mb.loss.advantage, mb.loss.token_weight, loss_config)
        return terms.loss + z_loss(output, semantic_tokens), {}

    return loss_fn


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_duplicate_step_runs_each_microbatch_forward_then_backward(name):
    """The step of a duplicate plan has no links and the events forward k, backward k; the runner gives bitwise the
    gradients, losses and log-probs of calling the model on each microbatch and backwarding its loss in slot order."""
    config = small_config(name)
    torch.manual_seed(0)
    model = HybridForCausalLM(config)
    direct = copy.deepcopy(model)
    model.set_activation_checkpointing(True)
    direct.set_activation_checkpointing(True)
    trajectories = step_trajectories(config, trees=2)
    step = prepare_step(trajectories, plan_step(trajectories, 192, 1, "duplicate"), dp_rank=0, dp_group=None,
                        model_config=config, aggregation="token-mean", device=torch.device("cpu"))
    assert len(step) >= 3 and not step.carries and all(mb.links is None for mb in step)
    assert step.events == forward_backward_events(len(step))
    loss_fn = _policy_loss(PolicyLossConfig(), sum(len(t) for t in trajectories))

    metrics = PlainRunner(model).train_step(step, loss_fn, temperature=0.7, entropy=True)
    losses = []
    for mb in step:
        output = direct(TreeContext(mb.layout), entropy=True, temperature=0.7)
        loss, _ = loss_fn(output.logprobs, mb, output)
        loss.backward()
        losses.append(loss.detach().to(torch.float64))
    assert metrics.loss == float(torch.stack(losses).sum())
    for (name_, p), q in zip(model.named_parameters(), direct.parameters()):
        assert torch.equal(p.grad, q.grad), name_
    with torch.no_grad():
        expected = [direct(TreeContext(mb.layout), temperature=0.7).logprobs.to(torch.float64) for mb in step]
    for got, want in zip(PlainRunner(model).score(step, temperature=0.7), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_duplicate_and_carry_plans_give_the_same_gradients(name):
    """One batch planned in duplicate and in carry mode (trees cut into parts that read context): both steps go
    through `PlainRunner.train_step` and give the loss and every gradient of each other (float64 tolerances)."""
    config = small_config(name)
    tol = TOLERANCES["float64"]
    trajectories = step_trajectories(config, trees=2)
    loss_config = PolicyLossConfig()
    loss_fn = _policy_loss(loss_config, sum(len(t) for t in trajectories))
    results = {}
    for mode in ("duplicate", "carry"):
        torch.manual_seed(0)
        model = HybridForCausalLM(config)
        model.set_activation_checkpointing(True)
        plan = plan_step(trajectories, 192, 1, mode)
        step = prepare_step(trajectories, plan, dp_rank=0, dp_group=None, model_config=config,
                            aggregation=loss_config.aggregation, device=torch.device("cpu"))
        assert step.carries == (mode == "carry")
        metrics = PlainRunner(model).train_step(step, loss_fn)
        results[mode] = (step, metrics.loss, {n: p.grad for n, p in model.named_parameters()})
    (duplicate, loss_d, grads_d), (carry, loss_c, grads_c) = results["duplicate"], results["carry"]
    assert any(mb.links.imports for mb in carry), "the carry plan must carry context"
    assert sum(mb.num_compact for mb in carry) < sum(mb.num_compact for mb in duplicate)
    assert abs(loss_c - loss_d) <= tol["loss"] * abs(loss_d)
    for n, g in grads_d.items():
        assert (grads_c[n] - g).norm() <= tol["grad_rtol"] * g.norm(), n
