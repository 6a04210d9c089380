"""Flat packed forward of HybridForCausalLM: packing, positions, batch input, checkpointing, tied head, float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import models

PRESETS = ("tiny-qwen3-next", "tiny-kimi-linear")
# A sequence across a 64-token chunk boundary, a 1-token sequence, one of 64 + 1 tokens, a short one.
LENGTHS = (70, 1, 65, 14)


def build(name: str, **overrides) -> models.HybridForCausalLM:
    config = models.preset(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = models.HybridForCausalLM(config)
    with torch.no_grad():  # make zero-initialised norm weights and expert biases non-trivial
        for key, tensor in model.state_dict().items():
            if key.endswith(("norm.weight", "e_score_correction_bias")):
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model


def ids_for(lengths, seed=1):
    return torch.randint(1, 1024, (sum(lengths),), generator=torch.Generator().manual_seed(seed))


def cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0)


@pytest.mark.parametrize("name", PRESETS)
def test_packed_equals_separate_sequences(name):
    model = build(name)
    ids = ids_for(LENGTHS)
    with torch.no_grad():
        packed = model.flat_forward(ids, cu_seqlens=cu(LENGTHS))
        parts = [model.flat_forward(part) for part in ids.split(LENGTHS)]
    separate = torch.cat([p.logits for p in parts])
    err = ((packed.logits - separate).norm() / separate.norm()).item()
    print(f"packed vs separate: rel err {err:.2e}")
    assert err < 1e-6
    for layer, stats in enumerate(packed.moe_stats):
        if stats is not None:
            summed = sum((p.moe_stats[layer] for p in parts[1:]), parts[0].moe_stats[layer])
            assert torch.equal(stats.expert_counts, summed.expert_counts)


@pytest.mark.parametrize("name", PRESETS)
def test_positions_restart_per_sequence_and_batch_input_is_packed(name):
    model = build(name)
    ids = ids_for((75, 75))
    positions = torch.cat([torch.arange(75), torch.arange(75)])
    with torch.no_grad():
        default = model.flat_forward(ids, cu_seqlens=cu((75, 75))).logits
        explicit = model.flat_forward(ids, position_ids=positions, cu_seqlens=cu((75, 75))).logits
        batched = model.flat_forward(ids.view(2, 75)).logits
    assert torch.equal(default, explicit)
    assert torch.equal(batched.view(150, -1), default)


def test_positions_reach_rope():
    model = build("tiny-qwen3-next")
    ids = ids_for((30,))
    with torch.no_grad():
        a = model.flat_forward(ids).logits
        b = model.flat_forward(ids, position_ids=torch.arange(30) * 7).logits
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("name", PRESETS)
def test_activation_checkpointing_gives_the_same_gradients(name):
    model = build(name)
    ids = ids_for((70, 20))
    grads = []
    for layers in (False, [0, 3]):
        model.zero_grad()
        model.set_activation_checkpointing(layers)
        out = model.flat_forward(ids, cu_seqlens=cu((70, 20)))
        stats = [s for s in out.moe_stats if s is not None]
        (out.logits.square().mean() + models.load_balancing_loss(sum(stats[1:], stats[0]))).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert [layer.recompute is not None for layer in model.model.layers] == [True, False, False, True]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_tied_embeddings():
    model = build("tiny-kimi-linear", tie_word_embeddings=True)
    assert "lm_head.weight" not in model.state_dict()
    assert model.lm_head_weight is model.model.embed_tokens.weight
    ids = ids_for((20,))
    with torch.no_grad():
        out = model.flat_forward(ids)
    assert torch.equal(out.logits, out.hidden @ model.model.embed_tokens.weight.T)
    assert torch.equal(model.hidden_states(ids).hidden, out.hidden)


@pytest.mark.parametrize("name", PRESETS)
def test_float64_model_agrees_with_float32(name):
    model = build(name)
    model64 = models.HybridForCausalLM(dataclasses.replace(model.config, dtype="float64"))
    model64.load_state_dict(model.state_dict())
    ids = ids_for((70,))
    with torch.no_grad():
        ref = model64.flat_forward(ids).logits
        out = model.flat_forward(ids).logits
    assert ref.dtype == torch.float64
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_bad_inputs_are_refused():
    model = build("tiny-qwen3-next")
    ids = ids_for((10,))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.flat_forward(ids, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="position_ids"):
        model.flat_forward(ids, position_ids=torch.arange(9))
    with pytest.raises(ValueError, match="input_ids"):
        model.flat_forward(ids.view(1, 1, 10))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.flat_forward(ids.view(2, 5), cu_seqlens=torch.tensor([0, 5, 10]))
