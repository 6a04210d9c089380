"""parallel.step in one process: the planner-driven microbatched step equals the whole step packed as one batch
(float64), the global normalisers reproduce app.losses.token_normalizers, and replicas get their slots in order."""

import copy

import numpy as np
import pytest
import torch

from app.losses import PolicyLossConfig, policy_loss, token_normalizers
from models.decoder import HybridForCausalLM
from parallel.metrics import build_metrics_logger, reduce_step
from parallel.step import replica_microbatches, step_normalizer, token_weights, train_step
from planner.microbatch import plan_microbatches
from planner.pack import pack
from tests.parallel.harness import TOLERANCES, reference_step, small_config, step_trajectories, z_loss


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_token_weights_sum_to_the_step_normalizers(aggregation):
    trajectories = step_trajectories(small_config("tiny-qwen3-next"), trees=2)
    rng = np.random.default_rng(1)
    for t in trajectories:
        t.weight = float(rng.uniform(0.5, 2.0))
    plan = plan_microbatches(trajectories, 128, dp=2)
    normalizer = step_normalizer([[trajectories[i] for i in mb.trajectories] for mb in plan.microbatches])
    whole = pack(trajectories)
    expected = token_normalizers(torch.as_tensor(whole.loss_mask), torch.as_tensor(whole.traj_index),
                                 whole.num_trajectories, PolicyLossConfig(aggregation=aggregation)).numpy()
    expected = expected * whole.weight
    for mb in plan.microbatches:
        got = token_weights(pack([trajectories[i] for i in mb.trajectories]), normalizer, aggregation)
        want = np.concatenate([expected[whole.traj_offsets[i]:whole.traj_offsets[i + 1]] for i in mb.trajectories])
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


def test_replica_microbatches_in_slot_order():
    trajectories = step_trajectories(small_config("tiny-qwen3-next"), trees=2)
    plan = plan_microbatches(trajectories, 128, dp=2)
    for d in range(2):
        mine = replica_microbatches(plan, trajectories, d)
        slots = sorted((mb.slot, mb.trajectories) for mb in plan.microbatches if mb.replica == d)
        assert [[id(t) for t in mb] for mb in mine] == [[id(trajectories[i]) for i in s[1]] for s in slots]
    with pytest.raises(ValueError, match="outside the plan's 2 replicas"):
        replica_microbatches(plan, trajectories, 2)


def test_single_process_step_matches_whole_batch(tmp_path):
    config = small_config("tiny-kimi-linear")
    torch.manual_seed(0)
    reference = HybridForCausalLM(config)
    model = copy.deepcopy(reference)
    model.set_activation_checkpointing(True)
    loss_config = PolicyLossConfig()
    trajectories = step_trajectories(config, trees=2)
    ref_loss, ref_grads, _ = reference_step(reference, trajectories, loss_config)
    microbatches = replica_microbatches(plan_microbatches(trajectories, 192, dp=1), trajectories, 0)
    normalizer = step_normalizer(microbatches)
    S = sum(len(t) for t in trajectories)

    def loss_fn(lp, batch, output):
        w = torch.as_tensor(token_weights(batch, normalizer, loss_config.aggregation))
        terms = policy_loss(lp, lp.detach(), torch.as_tensor(batch.advantage), w, loss_config)
        return terms.loss + z_loss(output, S), {"clip_fraction": terms.clip_fraction}

    metrics = train_step(model, microbatches, loss_fn)
    tol = TOLERANCES["float64"]
    assert len(microbatches) >= 3 and metrics.microbatches == len(microbatches)
    assert metrics.semantic_tokens == S and 0 < metrics.compact_rows < S
    assert abs(metrics.loss - ref_loss) <= tol["loss"] * abs(ref_loss)
    for name, p in model.named_parameters():
        assert (p.grad - ref_grads[name]).norm() <= tol["grad_rtol"] * ref_grads[name].norm(), name
    counts = [c for c in metrics.expert_counts if c is not None]
    assert len(counts) == 3 and all(float(c.sum()) == 2 * S for c in counts)  # top-2 of every semantic position
    with pytest.raises(ValueError, match="`microbatches` is empty"):
        train_step(model, [], loss_fn)
    scalars = reduce_step(metrics, None)
    assert scalars["compression"] == S / metrics.compact_rows and scalars["clip_fraction"] >= 0
    logger = build_metrics_logger(str(tmp_path / "tb"), rank=0)
    logger.log(scalars, step=1)
    logger.close()
    assert any((tmp_path / "tb").iterdir())
