"""models.load_hf / save_hf against transformers 5 (CPU, fp32): logits, gradients, names, round trips, errors.

Tolerances (relative Frobenius norm of the difference, fp32, same math in a different op order):
  logits 1e-5; gradients 2e-5, except the linear-attention decay parameters (A_log, dt_bias) 2e-3: their gradients
  cancel heavily, so that transformers' fp32 and ours both land ~5e-4 from the float64 gradient (measured on
  tiny-qwen3-next; ours in float64 is the reference there).
Sequences of 100 tokens span two 64-token chunks of the linear-attention core.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from models.hf_config import config_from_hf
from models.hf_io import HFCheckpointError
from models.moe import load_balancing_loss
from tests.models.hf_oracle import random_hf_model, tiny_kimi_linear_config, tiny_qwen3_next_config, transformers_cpu

LOGITS_RTOL = 1e-5
GRAD_RTOL = 2e-5
DECAY_GRAD_RTOL = 2e-3
FAMILIES = {"qwen3_next": tiny_qwen3_next_config, "kimi_linear": tiny_kimi_linear_config}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(transformers model, its save_pretrained directory, our model loaded from it)."""
    hf = random_hf_model(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path, models.load_hf(path)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 1024, (2, 100), generator=torch.Generator().manual_seed(1))


def test_load_hf_names_and_shapes_are_transformers(pair):
    hf, _, ours = pair
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == theirs


def test_load_hf_logits_match_transformers(pair, ids):
    hf, _, ours = pair
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours.flat_forward(ids).logits
    err = rel(out, ref)
    print(f"logits rel err {err:.2e}, max abs diff {(out - ref).abs().max():.2e}")
    assert err < LOGITS_RTOL


def test_load_hf_gradients_match_transformers(pair, ids):
    hf, _, ours = pair
    weight = torch.randn(*ids.shape, 1024, generator=torch.Generator().manual_seed(2))
    hf.zero_grad()
    ours.zero_grad()
    (hf(ids).logits * weight).sum().backward()
    (ours.flat_forward(ids).logits * weight).sum().backward()
    theirs = dict(hf.named_parameters())
    errors = {name: rel(p.grad, theirs[name].grad) for name, p in ours.named_parameters()}
    decay = {n for n in errors if n.endswith(("A_log", "dt_bias"))}
    for names, tol in ((decay, DECAY_GRAD_RTOL), (errors.keys() - decay, GRAD_RTOL)):
        worst = max(names, key=errors.get)
        print(f"worst gradient {worst}: rel err {errors[worst]:.2e} (tolerance {tol:.0e})")
        assert errors[worst] < tol


def test_load_balancing_loss_of_pooled_stats_is_transformers_aux_loss(tmp_path):
    # transformers computes the aux loss only for Qwen3-Next; it pools all MoE layers' counts and probabilities.
    hf = random_hf_model(tiny_qwen3_next_config(mlp_only_layers=[]))
    hf.save_pretrained(tmp_path)
    ours = models.load_hf(tmp_path)
    ids = torch.randint(1, 1024, (1, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True).aux_loss
        stats = ours.flat_forward(ids).moe_stats
    pooled = sum(stats[1:], stats[0])
    assert abs(load_balancing_loss(pooled).item() - ref.item()) < 1e-6 * ref.item()


def test_save_hf_then_load_hf_is_bitwise(pair, tmp_path):
    _, _, ours = pair
    models.save_hf(ours, tmp_path)
    again = models.load_hf(tmp_path)
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_transformers_loads_save_hf(pair, ids, tmp_path):
    hf, _, ours = pair
    models.save_hf(ours, tmp_path)
    tf = transformers_cpu()
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert rel(reloaded(ids).logits, ours.flat_forward(ids).logits) < LOGITS_RTOL
    for name, tensor in hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_save_hf_shards_and_writes_checkpoint_layout(pair, tmp_path):
    hf, hf_path, ours = pair
    models.save_hf(ours, tmp_path, max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 1
    # Same tensor names as transformers' own save_pretrained (the on-disk layout vLLM reads), except that
    # transformers names Kimi-Linear's dense-layer MLP `block_sparse_moe.` where the original checkpoints say `mlp.`.
    theirs = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp.")
              for k in load_file(hf_path / "model.safetensors")}
    assert set(index["weight_map"]) == theirs
    assert dict(models.checkpoint_tensors(ours)).keys() == theirs
    again = models.load_hf(tmp_path)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())


def test_load_hf_dtype(pair):
    _, path, _ = pair
    model = models.load_hf(path, dtype=torch.bfloat16)
    assert model.config.dtype == "bfloat16"
    for name, tensor in model.state_dict().items():
        expected = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert tensor.dtype == expected, name


NAME = "model.layers.3.self_attn.o_proj.weight"
BROKEN = {
    "shape": (rf"model\.safetensors: tensor '{NAME}' has shape \(\d+, \d+\), but config\.json implies",
              lambda t: t.__setitem__(NAME, t[NAME][:, :-1].contiguous())),
    "missing": (rf"model\.safetensors lacks tensor '{NAME}'", lambda t: t.pop(NAME)),
    "unexpected": (r"model\.safetensors has tensor 'model\.extra\.weight'",
                   lambda t: t.__setitem__("model.extra.weight", torch.zeros(1))),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_load_hf_errors_name_the_tensor(pair, tmp_path, case):
    _, _, ours = pair
    match, edit = BROKEN[case]
    models.save_hf(ours, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=match):
        models.load_hf(tmp_path)


def test_load_hf_rejects_other_architectures(pair, tmp_path):
    _, path, _ = pair
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM"):
        config_from_hf(dict(raw, architectures=["LlamaForCausalLM"]))
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, architectures=["LlamaForCausalLM"])))
    with pytest.raises(HFCheckpointError, match=r"config\.json: .*LlamaForCausalLM.*only"):
        models.load_hf(tmp_path)
