import numpy as np
import pytest
import torch

from app.advantages import assign_advantages
from app.objectives import PolicyLossConfig, policy_loss
from planner.trajectory import Trajectory


def test_clipped_surrogate_by_hand():
    lp = torch.tensor([0.0, -0.1, -2.0, -1.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-0.5, -0.1, -1.0, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    w = torch.tensor([0.25, 0.25, 0.25, 0.0], dtype=torch.float64)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, tis_cap=None)
    terms = policy_loss(lp, old, adv, w, cfg)
    r = np.exp([0.5, 0.0, -1.0])
    expected = -0.25 * (min(r[0] * 1, 1.28 * 1) + min(r[1] * 2, 2) + min(r[2] * -1, 0.8 * -1))
    assert terms.loss.item() == pytest.approx(expected, rel=1e-12)
    (g,) = torch.autograd.grad(terms.loss, lp)
    # token 0 is clipped (ratio e^0.5 > 1.28 with A > 0) and token 2 too (ratio e^-1 < 0.8 with A < 0): no gradient.
    assert g[0] == 0 and g[2] == 0 and g[3] == 0 and g[1] == pytest.approx(-0.25 * 2)
    assert terms.clip_fraction.item() == pytest.approx(2 / 3)


def test_kl_and_tis():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    rollout = torch.tensor([-3.0, -2.1], dtype=torch.float64)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    cfg = PolicyLossConfig(kl_coef=0.1, tis_cap=2.0)
    terms = policy_loss(lp, lp, torch.ones(2, dtype=torch.float64), w, cfg, rollout, ref)
    d = ref - lp
    assert terms.kl.item() == pytest.approx((0.5 * (d.exp() - d - 1)).sum().item())
    tis = torch.exp(lp - rollout).clamp(max=2.0)
    assert terms.policy.item() == pytest.approx(-(w * tis).sum().item())
    with pytest.raises(ValueError, match="reference log-probs"):
        policy_loss(lp, lp, torch.ones(2), w, cfg, rollout, None)


def test_bad_config():
    with pytest.raises(ValueError, match="clip_low"):
        PolicyLossConfig(clip_low=1.5)


def tree_batch():
    # prompt 1,2 ; branch A 3,4 -> leaves 5 (r=1) / 6 (r=0) ; branch B 7 (r=1)
    return [
        Trajectory([1, 2, 3, 4, 5], reward=1.0, tree="t"),
        Trajectory([1, 2, 3, 4, 6], reward=0.0, tree="t"),
        Trajectory([1, 2, 7], reward=1.0, tree="t"),
        Trajectory([9, 9], reward=0.5, tree="u"),
    ]


def test_tree_advantages():
    trajs = tree_batch()
    assign_advantages(trajs, "tree", scale_by_std=False)
    assert trajs[0].advantage.tolist() == pytest.approx([1 - 2 / 3] * 5)
    assert trajs[1].advantage[0] == pytest.approx(-2 / 3)
    assert trajs[3].advantage.tolist() == [0.0, 0.0]


def test_sibling_advantages_jump_at_forks_and_telescope():
    trajs = tree_batch()
    assign_advantages(trajs, "siblings", scale_by_std=False)
    a0 = trajs[0].advantage
    # root tokens 0; branch A (V=1/2) vs tree mean 2/3 at token 3; leaf 5 vs branch A at token 5.
    assert a0.tolist() == pytest.approx([0, 0, 0.5 - 2 / 3, 0, 0.5])
    assert trajs[2].advantage.tolist() == pytest.approx([0, 0, 1 - 2 / 3])
    for t in trajs[:3]:
        assert t.advantage.sum() == pytest.approx(t.reward - 2 / 3)


def test_missing_reward():
    with pytest.raises(ValueError, match="no reward"):
        assign_advantages([Trajectory([1, 2], tree="x")])
