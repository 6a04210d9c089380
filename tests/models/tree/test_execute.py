"""Tree execution of the hybrid model equals trajectory-wise execution (float64, CPU, <= 1e-10 relative).

The reference is the model's own flat packed forward over every trajectory separately (an independent code path:
no trie, no plan, zero initial states, causal varlen attention). Compared: semantic log-probs, a per-token policy
loss, MoE aux losses, and every parameter gradient; without recomputation, with full recomputation and with each
selective option of `tests.models.test_recompute.OPTIONS`. The no-replay ablation
must differ measurably on the same trees in float32 (in float64 every chunking agrees to rounding).
"""

import dataclasses

import numpy as np
import pytest
import torch

from bench.branching import nested_fork_trajectories
from models.config import GDNConfig
from models.decoder import HybridForCausalLM
from models.logprobs import naive_compact_logprobs
from models.microbatch import prepare_microbatch
from models.moe import load_balancing_loss, router_z_loss
from models.presets import preset
from models.tree.layout import TreeLayout
from models.tree.mixers import TreeContext
from planner.calls.plan import plan_calls
from planner.cost_model import CostModel
from planner.microbatch.flat import leaf_rows, with_flat_choices
from planner.microbatch.plan import MicrobatchPlan, PlannedMicrobatch
from planner.pack import pack
from tests.models.test_recompute import OPTIONS

TOL = 1e-10


def small_config(name: str):
    """The preset's architecture at test size: small widths, small chunks so forks cross many chunk boundaries."""
    c = preset(name)
    if isinstance(c.linear_attention, GDNConfig):
        lin = dataclasses.replace(c.linear_attention, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                                  chunk_size=16)
        full = dataclasses.replace(c.full_attention, num_heads=4, num_kv_heads=2, head_dim=16)
    else:
        lin = dataclasses.replace(c.linear_attention, num_heads=2, head_dim=8, chunk_size=32)
        full = dataclasses.replace(c.full_attention, num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                   qk_rope_head_dim=8, v_head_dim=8)
    moe = dataclasses.replace(c.moe, num_experts=4, top_k=2, expert_intermediate_size=16,
                              shared_expert_intermediate_size=16)
    return dataclasses.replace(
        c, vocab_size=64, hidden_size=32, linear_attention=lin, full_attention=full, moe=moe,
        dense_ffn=dataclasses.replace(c.dense_ffn, intermediate_size=48),
    )


def make_model(name, dtype, seed=0):
    torch.manual_seed(seed)
    dtype_name = {torch.float64: "float64", torch.float32: "float32"}[dtype]
    return HybridForCausalLM(dataclasses.replace(small_config(name), dtype=dtype_name))


def objective(logprobs, stats, batch):
    adv = torch.as_tensor(batch.advantage, dtype=logprobs.dtype)
    mask = torch.as_tensor(batch.loss_mask, dtype=logprobs.dtype)
    policy = -(adv * mask * logprobs).sum() / mask.sum()
    moe = [s for s in stats if s is not None]
    pooled = moe[0]
    for s in moe[1:]:
        pooled = pooled + s
    return policy + 0.01 * load_balancing_loss(pooled) + 0.001 * router_z_loss(pooled), pooled


def flat_run(model, trajectories, batch):
    ids = torch.as_tensor(np.concatenate([t.tokens for t in trajectories]))
    cu = torch.as_tensor(batch.traj_offsets)
    pos = torch.cat([torch.arange(len(t)) for t in trajectories])
    out = model.hidden_states(ids, pos, cu)
    logp = torch.log_softmax((out.hidden @ model.lm_head_weight.T).to(torch.float64 if ids.dtype else None), -1)
    lp = torch.zeros(ids.numel(), dtype=logp.dtype)
    nxt = torch.arange(1, ids.numel())
    keep = torch.ones(ids.numel() - 1, dtype=torch.bool)
    keep[cu[1:-1] - 1] = False  # a trajectory's last token predicts nothing
    src = nxt[keep]
    lp[src] = logp[src - 1].gather(1, ids[src, None])[:, 0]
    return lp, out.moe_stats


def tree_run(model, batch, chunk, replay=True):
    plan = plan_calls(batch, chunk, replay=replay)
    layout = TreeLayout.build(batch, plan, model.config.linear_attention.conv_size)
    out = model(TreeContext(layout))
    return out.logprobs, out.moe_stats, plan


def grads(model, loss):
    params = [p for p in model.parameters()]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
@pytest.mark.parametrize("recompute", [False, True, *OPTIONS.values()], ids=["none", "full", *OPTIONS])
def test_tree_equals_flat_float64(name, recompute):
    rng = np.random.default_rng(7)
    model = make_model(name, torch.float64)
    chunk = model.config.linear_attention.chunk_size
    trajectories = nested_fork_trajectories(rng, chunk, model.config.vocab_size, depth=5)
    batch = pack(trajectories)
    model.set_activation_checkpointing(recompute)

    lp_t, stats_t, plan = tree_run(model, batch, chunk)
    assert plan.num_rounds >= 2 and plan.total_replay > 0 and plan.handoff_depth.max() >= 5
    loss_t, pooled_t = objective(lp_t, stats_t, batch)
    g_t = grads(model, loss_t)

    model.set_activation_checkpointing(False)
    lp_f, stats_f = flat_run(model, trajectories, batch)
    loss_f, pooled_f = objective(lp_f, stats_f, batch)
    g_f = grads(model, loss_f)

    assert (lp_t - lp_f).abs().max().item() <= TOL
    assert abs(loss_t.item() - loss_f.item()) <= TOL * abs(loss_f.item())
    assert (pooled_t.expert_counts == pooled_f.expert_counts).all()
    assert abs(load_balancing_loss(pooled_t).item() - load_balancing_loss(pooled_f).item()) <= TOL
    assert abs(router_z_loss(pooled_t).item() - router_z_loss(pooled_f).item()) <= TOL
    worst = 0.0
    for (n, p), a, b in zip(model.named_parameters(), g_t, g_f):
        if b is None:
            continue
        assert a is not None, n
        worst = max(worst, (a - b).norm().item() / max(b.norm().item(), 1e-30))
    assert worst <= TOL, worst


def test_tree_forward_entropy():
    """`model(ctx, entropy=True)`: the same log-probs and hidden states as without, the entropies of the LM head over
    those hidden states, and `tree_hidden_states` the same hidden states; a plan made with another chunk size is
    refused."""
    model = make_model("tiny-kimi-linear", torch.float64)
    chunk = model.config.linear_attention.chunk_size
    batch = pack(nested_fork_trajectories(np.random.default_rng(2), chunk, model.config.vocab_size, depth=2))
    layout = TreeLayout.build(batch, plan_calls(batch, chunk), model.config.linear_attention.conv_size)
    with torch.no_grad():
        out = model(TreeContext(layout))
        out_e = model(TreeContext(layout), entropy=True)
        hidden = model.tree_hidden_states(TreeContext(layout)).hidden
    _, want = naive_compact_logprobs(out.hidden, model.lm_head_weight, layout.logit_row, layout.target, entropy=True)
    assert torch.equal(out_e.logprobs, out.logprobs) and torch.equal(out_e.hidden, out.hidden)
    assert torch.equal(hidden, out.hidden) and out.entropy is None
    torch.testing.assert_close(out_e.entropy, want, rtol=1e-12, atol=1e-12)
    other = TreeLayout.build(batch, plan_calls(batch, 2 * chunk), model.config.linear_attention.conv_size)
    with pytest.raises(ValueError, match=f"chunk_size={chunk}"):
        model(TreeContext(other))


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_flat_expansion_equals_flat_float64(name):
    """A microbatch the cost model sends flat (the planner's choice, `planner.microbatch.flat.with_flat_choices`) is
    packed unshared (`prepare_microbatch(flat=True)`), reads its rows of k and v in place, and equals
    trajectory-wise execution like the trie does; the default cost model keeps the trie, as does an expansion longer
    than the capacity; the planner's view-row count (`leaf_rows`, no call plan) is the plan's and the layout's."""
    rng = np.random.default_rng(3)
    model = make_model(name, torch.float64)
    chunk = model.config.linear_attention.chunk_size
    trajectories = nested_fork_trajectories(rng, chunk, model.config.vocab_size, depth=3)
    cpu = torch.device("cpu")
    S = sum(len(t) for t in trajectories)

    def planned_flat(cost: CostModel, capacity: int) -> bool:
        one = PlannedMicrobatch(tuple(range(len(trajectories))), 0, 0, pack(trajectories).num_compact)
        plan = MicrobatchPlan((one,), 1, capacity, 0.0, "test")
        return with_flat_choices(plan, trajectories, cost).microbatches[0].flat

    assert planned_flat(CostModel(expansion_per_token=0.0), S)
    assert not planned_flat(CostModel(), S)
    assert not planned_flat(CostModel(expansion_per_token=0.0), S - 1)  # an expansion beyond the capacity stays a trie
    flat_mb = prepare_microbatch(trajectories, model.config, cpu, flat=True)
    trie_mb = prepare_microbatch(trajectories, model.config, cpu)
    assert flat_mb.flat and not trie_mb.flat
    assert flat_mb.num_compact == flat_mb.num_semantic > trie_mb.num_compact
    assert all(g.own_rows for g in flat_mb.layout.attention.groups)
    for mb in (flat_mb, trie_mb):
        assert mb.call_plan.view_rows(mb.batches[0].positions) == mb.layout.attention.kv_index.numel()
    assert leaf_rows(trajectories) == trie_mb.layout.attention.kv_index.numel()

    out = model(TreeContext(flat_mb.layout))
    lp_t = out.logprobs
    loss_t, _ = objective(lp_t, out.moe_stats, flat_mb.batches[0])
    g_t = grads(model, loss_t)
    lp_f, stats_f = flat_run(model, trajectories, trie_mb.batches[0])
    loss_f, _ = objective(lp_f, stats_f, trie_mb.batches[0])
    g_f = grads(model, loss_f)
    assert (lp_t - lp_f).abs().max().item() <= TOL
    assert abs(loss_t.item() - loss_f.item()) <= TOL * abs(loss_f.item())
    for a, b in zip(g_t, g_f):
        if b is not None:
            assert (a - b).norm().item() <= TOL * max(b.norm().item(), 1e-30)
