"""parallel.replica: the global normalisers give each microbatch its share of the whole step's loss weights (against
an independent whole-step reference), and replicas get their microbatches in slot order."""

import numpy as np
import pytest
import torch

from models.microbatch import token_weights
from parallel.replica import prepare_replica, replica_microbatches, step_normalizer
from planner.microbatch import plan_microbatches
from planner.pack import pack
from tests.parallel.harness import small_config, step_trajectories
from tests.reference import reference_token_weights


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_token_weights_sum_to_the_step_normalizers(aggregation):
    trajectories = step_trajectories(small_config("tiny-qwen3-next"), trees=2)
    rng = np.random.default_rng(1)
    for t in trajectories:
        t.weight = float(rng.uniform(0.5, 2.0))
    plan = plan_microbatches(trajectories, 128, dp=2)
    normalizer = step_normalizer([[trajectories[i] for i in mb.trajectories] for mb in plan.microbatches])
    whole = pack(trajectories)
    expected = reference_token_weights(torch.as_tensor(whole.loss_mask), torch.as_tensor(whole.traj_index),
                                       whole.num_trajectories, aggregation).numpy()
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


def test_prepared_replica_covers_the_step_once_with_its_loss_inputs():
    config = small_config("tiny-qwen3-next")
    trajectories = step_trajectories(config, trees=2)
    plan = plan_microbatches(trajectories, 128, dp=1)
    mbs = prepare_replica(trajectories, plan, dp_rank=0, dp_group=None, model_config=config,
                          aggregation="token-mean", device=torch.device("cpu"))
    assert len(mbs) == len(plan.microbatches) >= 2
    assert sum(mb.batch.num_semantic for mb in mbs) == sum(len(t) for t in trajectories)
    assert sorted(id(t) for mb in mbs for t in mb.batch.trajectories) == sorted(map(id, trajectories))
    assert sum(mb.loss.token_share for mb in mbs) == pytest.approx(1.0)
    trained = sum(int(np.count_nonzero(t.loss_mask[1:])) for t in trajectories)
    assert sum(float(mb.loss.token_weight.sum()) for mb in mbs) == pytest.approx(1.0)
    assert sum(int(mb.loss.trained.sum()) for mb in mbs) == trained
