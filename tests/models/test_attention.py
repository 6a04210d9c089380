"""Full-attention mixers: RoPE is relative (a constant position shift changes nothing), NoPE ignores positions,
and the varlen causal mask keeps sequences apart."""

from __future__ import annotations

import pytest
import torch

from models.attention_core import VarlenCausalMask, naive_attention
from models.config import GatedAttentionConfig, MLAConfig
from models.gated_attention import GatedAttention
from models.mla import MLA


def mla(rope: bool) -> MLA:
    torch.manual_seed(0)
    return MLA(MLAConfig(num_heads=2, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=16, rope=rope), hidden_size=48, zero_centered_norm=False)


def gated() -> GatedAttention:
    torch.manual_seed(0)
    config = GatedAttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, partial_rotary_factor=0.5)
    return GatedAttention(config, hidden_size=48, eps=1e-6, zero_centered_norm=True)


def run(module, positions):
    x = torch.randn(20, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return module(x, positions, VarlenCausalMask(torch.tensor([0, 20])))


@pytest.mark.parametrize("make", [lambda: mla(True), gated], ids=["mla-rope", "gated-gqa"])
def test_rope_is_relative(make):
    module = make()
    base = run(module, torch.arange(20))
    assert torch.allclose(run(module, torch.arange(20) + 1000), base, rtol=1e-4, atol=1e-5)
    assert (run(module, torch.arange(20) * 3) - base).abs().max() > 1e-3


def test_mla_without_rope_ignores_positions():
    module = mla(False)
    assert torch.equal(run(module, torch.arange(20)), run(module, torch.arange(20) * 3))
    assert not torch.allclose(run(mla(True), torch.arange(20)), run(module, torch.arange(20)))


def test_varlen_causal_mask():
    mask = VarlenCausalMask(torch.tensor([0, 2, 5])).dense()
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_naive_attention_groups_query_heads_onto_kv_heads():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 5, generator=g)
    mask = VarlenCausalMask(torch.tensor([0, 6])).dense()
    out = naive_attention(q, k, v, mask, 0.3)
    for h in range(4):
        scores = (q[:, h] @ k[:, h // 2].T * 0.3).masked_fill(~mask, float("-inf"))
        assert torch.allclose(out[:, h], scores.softmax(-1) @ v[:, h // 2], atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen flash kernel needs CUDA")
@pytest.mark.parametrize("heads, kv_heads, v_dim", [(4, 4, 64), (4, 2, 40)])
def test_varlen_flash_matches_naive_on_cuda(heads, kv_heads, v_dim):
    """The flat path's kernel (`attention` on a VarlenCausalMask in bf16) against the fp32 reference, with GQA and a
    value dim below the query/key dim (MLA: v is padded for the kernel and the output cut)."""
    from models.attention_core import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 70, 71, 300], device="cuda")
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = rand(300, heads, 64), rand(300, kv_heads, 64), rand(300, kv_heads, v_dim)
    mask = VarlenCausalMask(cu)
    out = attention(q, k, v, mask, 0.125)
    ref = naive_attention(q.float(), k.float(), v.float(), mask.dense(), 0.125)
    assert out.shape == (300, heads, v_dim)
    assert (out.float() - ref).abs().max().item() < 2e-2
