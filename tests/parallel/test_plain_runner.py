"""parallel.plain_runner in one process: the planner-driven microbatched step equals the whole step packed as one
batch (float64), and its metrics reduce."""

import copy

import pytest
import torch

from app.objectives import PolicyLossConfig, policy_loss
from models.decoder import HybridForCausalLM
from parallel.metrics import reduce_step
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_replica
from planner.microbatch.plan import plan_microbatches
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
    microbatches = prepare_replica(trajectories, plan_microbatches(trajectories, 192, dp=1), dp_rank=0,
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
    with pytest.raises(ValueError, match="`microbatches` is empty"):
        runner.train_step([], loss_fn)
    scalars = reduce_step(metrics, None)
    assert scalars["compression"] == S / metrics.compact_rows and scalars["clip_fraction"] >= 0
