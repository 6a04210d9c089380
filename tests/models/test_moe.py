"""MoE router statistics: row weights stand for duplicated rows; stats add across microbatches; expert bias."""

from __future__ import annotations

import pytest
import torch

from models.config import MoEConfig
from models.moe import MoE, load_balancing_loss, router_z_loss

CONFIGS = {
    "softmax": MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=32, shared_expert_intermediate_size=32,
                         shared_expert_gate=True),
    "sigmoid-groups": MoEConfig(num_experts=8, top_k=3, expert_intermediate_size=32, score_func="sigmoid",
                                routed_scaling_factor=2.5, num_groups=4, topk_groups=2, expert_bias=True,
                                shared_expert_intermediate_size=32),
}


def make(name: str, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(CONFIGS[name], hidden_size=48)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.2)
        if moe.config.expert_bias:
            moe.gate.e_score_correction_bias.normal_(std=0.05)
    return moe


def aux(stats):
    return load_balancing_loss(stats) + router_z_loss(stats)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_row_weight_equals_duplicated_rows(name):
    moe = make(name)
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(1), requires_grad=True)
    q = torch.randint(1, 4, (37,), generator=torch.Generator().manual_seed(2))
    x_dup = x.detach().repeat_interleave(q, dim=0).requires_grad_()
    y, compact = moe(x, row_weight_T=q)
    y_dup, full = moe(x_dup)
    assert torch.allclose(y.repeat_interleave(q, dim=0), y_dup, atol=1e-6)
    assert compact.tokens.item() == full.tokens.item() == q.sum().item()
    assert torch.equal(compact.expert_counts, full.expert_counts)
    assert torch.allclose(compact.prob_mass, full.prob_mass, rtol=1e-6)
    assert torch.allclose(compact.z_sum, full.z_sum, rtol=1e-6)
    aux(compact).backward()
    aux(full).backward()
    # The gradient of a row equals the summed gradient of its duplicates.
    summed = torch.zeros_like(x).index_add_(0, torch.arange(37).repeat_interleave(q), x_dup.grad)
    assert torch.allclose(x.grad, summed, rtol=1e-5, atol=1e-8)


def test_stats_add_across_microbatches():
    moe = make("sigmoid-groups")
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(3))
    _, whole = moe(x)
    _, a = moe(x[:13])
    _, b = moe(x[13:])
    both = a + b
    assert torch.equal(both.expert_counts, whole.expert_counts)
    assert torch.allclose(both.prob_mass, whole.prob_mass, rtol=1e-6)
    assert torch.allclose(aux(both), aux(whole), rtol=1e-6)
    assert whole.expert_counts.sum().item() == 40 * 3


def test_group_limited_routing_stays_in_the_best_groups():
    moe = make("sigmoid-groups")
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(4))
    routing = moe.gate(x)
    choice = routing.scores + moe.gate.e_score_correction_bias
    group_score = choice.view(64, 4, 2).topk(2, dim=-1).values.sum(-1)
    best = group_score.topk(2, dim=-1).indices
    groups_used = routing.experts // 2
    assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups_used, best))
    # Weights: renormalised sigmoid scores of the chosen experts (not biased), times the routed scaling.
    expected = routing.scores.gather(1, routing.experts)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5
    assert torch.allclose(routing.weights, expected)


def test_update_expert_bias_moves_load_towards_the_mean():
    moe = make("sigmoid-groups")
    bias = moe.gate.e_score_correction_bias.clone()
    counts = torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5])
    moe.gate.update_expert_bias(counts, rate=0.01)
    step = moe.gate.e_score_correction_bias - bias
    assert step[0] < 0 < step[1] and torch.all(step[2:] == 0)
    with pytest.raises(ValueError, match="expert_bias"):
        make("softmax").gate.update_expert_bias(counts, rate=0.01)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_logits_do_not_depend_on_the_other_rows(device, dtype):
    """A row's fp32 router logits are bitwise the same in a call of 7 rows, of 5,000 rows and after a shuffle (one
    GEMM per batch is not: on CPU, plain F.linear differs here for 7 rows vs 5,000), and equal x @ W.T (bf16 inputs:
    the bf16 path's GEMMs writing fp32)."""
    from models.moe import router_logits

    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(5000, 256, generator=g).to(device, dtype), torch.randn(64, 256, generator=g).to(device, dtype))
    full = router_logits(x, w)
    perm = torch.randperm(5000, generator=g).to(device)
    assert torch.equal(router_logits(x[:7], w), full[:7])
    assert torch.equal(router_logits(x[perm], w), full[perm])
    assert full.dtype == torch.float32
    assert torch.allclose(full, x.float() @ w.float().T, rtol=1e-5, atol=1e-4)
    assert router_logits(x[:0], w).shape == (0, 64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_bf16_router_logits_match_the_reference(device):
    """bf16 rows and weights: logits and both gradients as the reference's fp32 GEMMs on upcast copies (logits to
    fp32 summation order; gradients to their bf16 rounding: the fp32 output gradient enters as two bf16 parts)."""
    from models.moe import naive_router_logits, router_logits

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4500, 256, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(64, 256, generator=g) / 16).to(device, torch.bfloat16)
    dlogits = torch.randn(4500, 64, generator=g).to(device)
    results = []
    for fn in (router_logits, naive_router_logits):
        leaves = [t.detach().requires_grad_() for t in (x, w)]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, dlogits)))
    (out, dx, dw), (ref, ref_dx, ref_dw) = results
    assert out.dtype == ref.dtype == torch.float32 and dx.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in ((dx, ref_dx), (dw, ref_dw)):
        # One bf16 ulp of each value, plus 2^-17 of the largest (the split's error, met where a sum cancels).
        bound = 2**-7 * b.float().abs() + 2**-17 * b.float().abs().max()
        assert ((a.float() - b.float()).abs() <= bound).all(), ((a.float() - b.float()).abs() - bound).max()
