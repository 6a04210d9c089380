"""The step API of the linear-attention mixers (GDN, KDA), as tree execution uses it: a sequence split at a chunk
boundary, continued from the conv and core states of its first part, reproduces the one-call forward bitwise; the
boundary state requested inside a call is the state the split call hands over."""

from __future__ import annotations

import pytest
import torch

from models.config import GDNConfig, KDAConfig
from models.gdn import GatedDeltaNet
from models.kda import KimiDeltaAttention
from models.linear_attention import CoreInputs

MIXERS = {
    "gdn": lambda: GatedDeltaNet(GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16, chunk_size=32),
                                 hidden_size=64, eps=1e-6),
    "kda": lambda: KimiDeltaAttention(KDAConfig(num_heads=2, head_dim=32, chunk_size=32), hidden_size=64, eps=1e-5),
}
# SPLIT is a multiple of the chunk size 32.
T, SPLIT = 100, 64


def rows_of(inputs: CoreInputs, sl: slice) -> CoreInputs:
    return CoreInputs(inputs.q[sl], inputs.k[sl], inputs.v[sl], inputs.g[sl], inputs.beta[sl])


@pytest.fixture(params=sorted(MIXERS))
def mixer(request):
    torch.manual_seed(0)
    m = MIXERS[request.param]()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.1)
    return m


def test_split_at_chunk_boundary_with_handed_over_states_is_bitwise(mixer):
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(1))
    whole = torch.tensor([0, T])
    with torch.no_grad():
        reference = mixer(x, whole)
        rows = mixer.project(x)
        conv_a, conv_state = mixer.conv(rows.qkv[:SPLIT], torch.tensor([0, SPLIT]), output_final_state=True)
        conv_b, _ = mixer.conv(rows.qkv[SPLIT:], torch.tensor([0, T - SPLIT]), initial_state=conv_state)
        conv_all, _ = mixer.conv(rows.qkv, whole)
        assert [t.shape[1] for t in conv_all] == list(mixer.conv_groups())
        for a, b, whole_rows in zip(conv_a, conv_b, conv_all):
            assert torch.equal(torch.cat([a, b]), whole_rows)

        inputs = mixer.activate(rows, conv_all)
        o_a, state = mixer.core(rows_of(inputs, slice(0, SPLIT)), torch.tensor([0, SPLIT]), output_final_state=True)
        o_b, _ = mixer.core(rows_of(inputs, slice(SPLIT, T)), torch.tensor([0, T - SPLIT]), initial_state=state)
        o_all, _ = mixer.core(inputs, whole)
        assert torch.equal(torch.cat([o_a, o_b]), o_all)
        assert torch.equal(mixer.output(o_all, rows), reference)


def test_steps_are_row_wise(mixer):
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        rows, rows_p = mixer.project(x), mixer.project(x[perm])
        conv = torch.randn_like(rows.qkv).split(mixer.conv_groups(), dim=-1)
        a, b = mixer.activate(rows, conv), mixer.activate(rows_p, tuple(t[perm] for t in conv))
        for name in ("q", "k", "v", "g", "beta"):
            assert torch.allclose(getattr(a, name)[perm], getattr(b, name), rtol=1e-6, atol=1e-7), name
        o = torch.randn_like(a.v)
        assert torch.allclose(mixer.output(o, rows)[perm], mixer.output(o[perm], rows_p), rtol=1e-5, atol=1e-6)
