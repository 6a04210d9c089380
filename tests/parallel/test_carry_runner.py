"""Prefix carry equals trajectory-wise training (float64, CPU, <= 1e-10 relative).

Two rollout trees, each cut into parts at rows chosen here (forks at B-1, B and B+1 of the chunk grid right at part
boundaries, and cuts inside a segment); microbatch k holds part k of each tree; they run through
`parallel.plain_runner.PlainRunner` in the default event order (forwards, then backwards in reverse). The reference
is the model's flat packed forward over every trajectory separately (no trie, no plan, no carry), with the step's
loss weights over all positions. Compared: per-position log-probs, the step loss, the router z-loss (linear in the
rows, so its sum over microbatches is the trajectory-wise one), the load-balancing loss of each microbatch against
the flat run restricted to that microbatch's rows (it is nonlinear per microbatch, with or without carry), and every
parameter gradient; GDN and KDA families, MoE, recomputation off, full and each selective option
(`tests.models.test_recompute.OPTIONS`). Ablations that drop the gradients injected
into the carried keys/values or states must fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from models.carry_microbatch import prepare_carry_step
from models.decoder import FlatContext, flat_context
from models.linear_attention import LinearAttention
from models.microbatch import StepNormalizer, trained_counts
from models.moe import load_balancing_loss, pooled_stats, router_z_loss
from models.step import Step
from models.tree.carry_exchange import LATENT_NAMES, NAMES, CarryExchange
from parallel import plain_runner
from parallel.plain_runner import PlainRunner
from planner.pack import pack
from tests.models.test_recompute import OPTIONS
from tests.models.tree.test_carry_microbatch_layout import carry_parts, step_trees
from tests.models.tree.test_execute import make_model
from tests.reference import reference_token_weights

TOL = 1e-10
AUX, Z = 0.01, 0.001


def microbatch_loss(logprobs_S, mb, output):
    """Policy-gradient loss under the step's weights plus both router losses weighted by the token share."""
    loss = mb.loss
    policy = -(loss.token_weight * loss.advantage * logprobs_S).sum()
    pooled = pooled_stats(output.moe_stats)
    lb, z = load_balancing_loss(pooled), router_z_loss(pooled)
    total = policy + loss.token_share * (AUX * lb + Z * z)
    return total, {"z": (loss.token_share * z).detach(), f"lb{id(mb)}": lb.detach()}


@dataclass
class WeightedFlatContext(FlatContext):
    """A flat forward whose MoE statistics count only the positions with weight 1 (a microbatch's rows)."""

    weight: torch.Tensor | None = None

    @property
    def row_weight(self) -> torch.Tensor | None:
        return self.weight


def flat_reference(model, trees, step: Step):
    """Per-position log-probs [S] (trees, then trajectories, in order), the step loss, the z-loss, and each
    microbatch's load-balancing loss restricted to its rows; all from flat forwards of every trajectory."""
    trajectories = [t for ts in trees for t in ts]
    ids = torch.as_tensor(np.concatenate([t.tokens for t in trajectories]))
    lengths = [len(t) for t in trajectories]
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]))
    pos = torch.cat([torch.arange(n) for n in lengths])
    base = flat_context(ids.numel(), pos, cu, ids.device)

    def forward(weight=None):
        ctx = WeightedFlatContext(base.position_ids, base.cu_seqlens, base.mask, weight)
        return model.decode(model.model.embed_tokens(ids), ctx)

    out = forward()
    logp = torch.log_softmax(out.hidden @ model.lm_head_weight.T, -1)
    lp = torch.zeros(ids.numel(), dtype=logp.dtype)
    starts = cu[:-1]
    src = torch.arange(1, ids.numel())
    src = src[~torch.isin(src, starts)]
    lp[src] = logp[src - 1].gather(1, ids[src, None])[:, 0]

    mask = torch.as_tensor(np.concatenate([t.loss_mask for t in trajectories])).clone()
    mask[starts] = False
    traj_index = torch.repeat_interleave(torch.arange(len(trajectories)), torch.as_tensor(lengths))
    weights = reference_token_weights(mask, traj_index, len(trajectories), "token-mean")
    weights = weights * torch.as_tensor([t.weight for t in trajectories], dtype=torch.float64)[traj_index]
    adv = torch.as_tensor(np.concatenate([t.advantage for t in trajectories]))
    loss = -(weights * adv * lp).sum()
    z = router_z_loss(pooled_stats(out.moe_stats))
    loss = loss + Z * z

    # Flat position of each tree position: trees in order, each tree's positions in its trajectories' order.
    tree_offsets = np.cumsum([0] + [sum(len(t) for t in ts) for ts in trees])
    rows_of = [pack(ts).sem_to_compact for ts in trees]
    balance = []
    for mb in step:
        owned = torch.zeros(ids.numel(), dtype=torch.float64)
        for p in mb.parts:
            rows = rows_of[p.tree]
            owned[tree_offsets[p.tree] + np.flatnonzero((rows >= p.start) & (rows < p.stop))] = 1.0
        lb = load_balancing_loss(pooled_stats(forward(owned).moe_stats))
        balance.append(lb)
        loss = loss + float(owned.sum()) / ids.numel() * AUX * lb
    return lp, loss, z, balance, tree_offsets


def prepare(trees, model):
    parts = carry_parts(trees, model.config.chunk_size)
    counts = trained_counts([t for ts in trees for t in ts])
    return prepare_carry_step(trees, parts, model.config, torch.device("cpu"), normalizer=StepNormalizer(*counts))


def relative_errors(reference, carried):
    out = {}
    for (name, p_ref), p in zip(reference.named_parameters(), carried.parameters()):
        if p_ref.grad is None:
            continue
        out[name] = (p_ref.grad - p.grad).norm().item() / max(p_ref.grad.norm().item(), 1e-30)
    return out


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
@pytest.mark.parametrize("recompute", [False, True, *OPTIONS.values()], ids=["none", "full", *OPTIONS])
def test_carry_equals_trajectory_wise(name, recompute):
    reference, model = make_model(name, torch.float64), make_model(name, torch.float64)
    B = model.config.chunk_size
    trees = step_trees(B, model.config.vocab_size)
    step = prepare(trees, model)

    # The cut is what the test is about: >= 3 parts, a part reading from 2 earlier parts, forks at B-1, B, B+1
    # at part boundaries (external roots), replay from carried rows and states at carried anchors.
    assert len(step) >= 3
    assert max(len(mb.links.producers) for mb in step) >= 2
    external = [mb.call_plan.schedule.tree for mb in step]
    forks = {int(t.start[g]) % B for t in external for g in np.flatnonzero(t.external >= 0)}
    assert {B - 1, 0, 1} <= forks, forks
    assert any(mb.call_plan.external_context.size for mb in step)
    assert any(mb.call_plan.external_state_context.size for mb in step)

    model.set_activation_checkpointing(recompute)
    runner = PlainRunner(model)
    result = runner.train_step(step, microbatch_loss)

    lp_ref, loss_ref, z_ref, balance_ref, tree_offsets = flat_reference(reference, trees, step)
    loss_ref.backward()

    scored = runner.score(step)
    worst_lp = 0.0
    for mb, lp in zip(step, scored):
        flat_index = np.concatenate([tree_offsets[p.tree] + s for p, s in zip(mb.parts, mb.scored)])
        worst_lp = max(worst_lp, (lp - lp_ref[flat_index].detach()).abs().max().item())
    assert sum(mb.num_semantic for mb in step) == lp_ref.numel()
    assert worst_lp <= TOL, worst_lp
    assert abs(result.loss - loss_ref.item()) <= TOL * abs(loss_ref.item())
    assert abs(result.extras["z"] - z_ref.item()) <= TOL * abs(z_ref.item())
    for mb, lb in zip(step, balance_ref):
        assert abs(result.extras[f"lb{id(mb)}"] - lb.item()) <= TOL * abs(lb.item())
    errors = relative_errors(reference, model)
    assert len(errors) == len(list(model.parameters()))
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize(("dropped", "name"), [("attention", "tiny-qwen3-next"), ("attention", "tiny-kimi-linear"),
                                             ("state", "tiny-qwen3-next")])
def test_carry_ablation_without_injected_gradients_fails(monkeypatch, dropped, name):
    """Dropping the gradients consumers send to the carried keys/values (MLA: latents and shared keys) or
    linear-attention states must break the parameter gradients: the test above can fail."""
    carried = []

    class Dropping(CarryExchange):
        def backward(self, slot):
            for mixer, leaves in self.leaves.get(slot, {}).items():
                attention = not isinstance(mixer, LinearAttention)
                if attention:
                    carried.append(tuple(leaves))
                for name, leaf in leaves.items():
                    if (dropped == "attention" and attention) or (dropped == "state" and name == "state"):
                        leaf.grad = None
            super().backward(slot)

    monkeypatch.setattr(plain_runner, "CarryExchange", Dropping)
    reference, model = make_model(name, torch.float64), make_model(name, torch.float64)
    trees = step_trees(model.config.chunk_size, model.config.vocab_size)
    step = prepare(trees, model)
    PlainRunner(model).train_step(step, microbatch_loss)
    flat_reference(reference, trees, step)[1].backward()
    assert max(relative_errors(reference, model).values()) > 1e-4
    expected = LATENT_NAMES if name == "tiny-kimi-linear" else NAMES["attention"]
    assert carried and all(names == expected for names in carried if names)


def test_single_trajectory_longer_than_a_microbatch():
    """One trajectory cut inside its path at B-1, B+1 and 2B of the chunk grid (parts of one segment), run with
    empty events and two trees' parts in separate microbatches (backward of a tree's last part right after its
    forward): log-probs and gradients equal trajectory-wise training."""
    reference, model = make_model("tiny-qwen3-next", torch.float64), make_model("tiny-qwen3-next", torch.float64)
    B = model.config.chunk_size
    both = step_trees(B, model.config.vocab_size)
    trees = [both[0][:1], both[1][:2]]
    parts = [[(0, 0, B - 1)], [(0, B - 1, B + 1)], [(0, B + 1, 2 * B)], [(0, 2 * B, pack(trees[0]).num_compact)],
             [(1, 0, pack(trees[1]).num_compact)]]
    events = [("forward", 0), ("forward", 1), ("forward", -1), ("forward", 2), ("forward", 3), ("backward", 3),
              ("backward", 2), ("forward", 4), ("backward", 4), ("backward", 1), ("backward", -1), ("backward", 0)]
    counts = trained_counts([t for ts in trees for t in ts])
    step = prepare_carry_step(trees, parts, model.config, torch.device("cpu"), events=events,
                              normalizer=StepNormalizer(*counts))
    assert [len(mb.links.producers) for mb in step] == [0, 1, 2, 3, 0]
    model.set_activation_checkpointing(True)
    runner = PlainRunner(model)
    result = runner.train_step(step, microbatch_loss)
    lp_ref, loss_ref, _, _, tree_offsets = flat_reference(reference, trees, step)
    loss_ref.backward()
    for mb, lp in zip(step, runner.score(step)):
        flat_index = np.concatenate([tree_offsets[p.tree] + s for p, s in zip(mb.parts, mb.scored)])
        assert (lp - lp_ref[flat_index].detach()).abs().max().item() <= TOL
    assert abs(result.loss - loss_ref.item()) <= TOL * abs(loss_ref.item())
    assert max(relative_errors(reference, model).values()) <= TOL


@pytest.mark.parametrize("events, message", [
    ([("forward", 1), ("forward", 0), ("backward", 1), ("backward", 0)], "have not run their forward"),
    ([("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)], "before the backward of microbatches \\[1\\]"),
])
def test_event_order_errors(events, message):
    model = make_model("tiny-kimi-linear", torch.float64)
    trees = step_trees(model.config.chunk_size, model.config.vocab_size)[:1]
    rows = pack(trees[0]).num_compact
    counts = trained_counts(trees[0])
    step = prepare_carry_step(trees, [[(0, 0, rows // 2)], [(0, rows // 2, rows)]], model.config,
                              torch.device("cpu"), events=events, normalizer=StepNormalizer(*counts))
    with pytest.raises(ValueError, match=message):
        PlainRunner(model).train_step(step, microbatch_loss)
