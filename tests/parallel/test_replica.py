"""parallel.replica: the global normalisers give each microbatch its share of the whole step's loss weights (against
an independent whole-step reference), and replicas get their share of either plan (`plan.replica`) in slot
order."""

import numpy as np
import pytest
import torch

from models.microbatch import token_weights
from parallel.replica import prepare_step, step_normalizer
from planner.carry.plan import CarryMicrobatch, CarryPart, CarryPlan
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack
from planner.replica_share import forward_backward_events
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
        share = plan.replica(d)
        slots = sorted((mb.slot, mb.trajectories) for mb in plan.microbatches if mb.replica == d)
        assert list(share.units) == [s[1] for s in slots] and not share.carries
        assert [[u for u, _, _ in parts] for parts in share.parts] == [[k] for k in range(len(slots))]
        assert share.events == forward_backward_events(len(slots))
    with pytest.raises(ValueError, match="outside the plan's 2 replicas"):
        plan.replica(2)


def test_prepared_replica_covers_the_step_once_with_its_loss_inputs():
    config = small_config("tiny-qwen3-next")
    trajectories = step_trajectories(config, trees=2)
    plan = plan_microbatches(trajectories, 128, dp=1)
    mbs = prepare_step(trajectories, plan, dp_rank=0, dp_group=None, model_config=config,
                       aggregation="token-mean", device=torch.device("cpu"))
    assert len(mbs) == len(plan.microbatches) >= 2
    assert sum(mb.batches[0].num_semantic for mb in mbs) == sum(len(t) for t in trajectories)
    assert sorted(id(t) for mb in mbs for t in mb.batches[0].trajectories) == sorted(map(id, trajectories))
    assert sum(mb.loss.token_share for mb in mbs) == pytest.approx(1.0)
    trained = sum(int(np.count_nonzero(t.loss_mask[1:])) for t in trajectories)
    assert sum(float(mb.loss.token_weight.sum()) for mb in mbs) == pytest.approx(1.0)
    assert sum(int(mb.loss.trained.sum()) for mb in mbs) == trained


def test_prepared_carry_replica_takes_its_parts_in_slot_order():
    """A CarryPlan over two replicas: each replica gets its trees' parts in slot order and its events with slots
    renumbered."""
    config = small_config("tiny-qwen3-next")
    trajectories = step_trajectories(config, trees=2)
    trees = [tuple(i for i, t in enumerate(trajectories) if t.tree == name)
             for name in dict.fromkeys(t.tree for t in trajectories)]
    rows = [pack([trajectories[i] for i in tree]).num_compact for tree in trees]
    microbatches = [
        CarryMicrobatch((CarryPart(0, 20, rows[0]),), replica=0, slot=3, compact_tokens=rows[0] - 20),
        CarryMicrobatch((CarryPart(0, 0, 20),), replica=0, slot=1, compact_tokens=20),
        CarryMicrobatch((CarryPart(1, 0, rows[1]),), replica=1, slot=1, compact_tokens=rows[1]),
    ]
    events = [[("forward", 1), ("forward", 3), ("backward", 3), ("backward", 1)],
              [("forward", 1), ("forward", -1), ("backward", -1), ("backward", 1)]]
    plan = CarryPlan(tuple(trees), tuple(microbatches), capacity=200, dp=2, events=tuple(map(tuple, events)))
    steps = [prepare_step(trajectories, plan, dp_rank=r, dp_group=None, model_config=config,
                          aggregation="token-mean", device=torch.device("cpu")) for r in range(2)]
    assert all(step.carries for step in steps)
    assert [[(p.start, p.stop) for p in mb.parts] for mb in steps[0]] == [[(0, 20)], [(20, rows[0])]]
    assert steps[0].events == (("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0))
    assert steps[1].events == (("forward", 0), ("forward", -1), ("backward", -1), ("backward", 0))
    # Without a DP group each replica normalises over its own trees: token-mean weights sum to 1 per replica.
    for step, tree in zip(steps, trees):
        assert sum(float(mb.loss.token_weight.sum()) for mb in step) == pytest.approx(1.0)
        assert sum(float(mb.loss.trained.sum()) for mb in step) == sum(
            trajectories[i].loss_mask[1:].sum() for i in tree)
