"""Gated RMSNorm reference against transformers' Qwen3NextRMSNormGated and KimiLinearRMSNormGated modules.

Tolerances: same operation order: bitwise (fp32 and bf16), gradients 1e-6 relative.
"""

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from models.ops.norm import gated_rms_norm
from models.ops.norm.naive import naive_rms_norm_gated

D = 24


def make_norm(module_cls, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    module = module_cls(D, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    x = (3 * torch.randn(7, 3, D, generator=gen)).to(dtype)
    g = torch.randn(7, 3, D, generator=gen).to(dtype)
    return module, x, g


CASES = {
    # name: (transformers module, our activation, round_normed_to_input_dtype)
    "qwen3_next": (Qwen3NextRMSNormGated, "swish", True),
    "kimi_linear": (KimiLinearRMSNormGated, "sigmoid", False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_bitwise(case, dtype):
    module_cls, activation, round_normed = CASES[case]
    module, x, g = make_norm(module_cls, dtype)
    expected = module(x, g)
    y = naive_rms_norm_gated(x, g, module.weight, 1e-5, activation, round_normed_to_input_dtype=round_normed)
    assert y.dtype == dtype
    assert torch.equal(y, expected), f"max abs diff {(y.float() - expected.float()).abs().max().item():.3e}"


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_transformers(case):
    module_cls, activation, round_normed = CASES[case]
    module, x, g = make_norm(module_cls, torch.float32)
    x.requires_grad_(True)
    g.requires_grad_(True)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    expected = torch.autograd.grad((module(x, g) * weight).sum(), [x, g, module.weight])
    y = naive_rms_norm_gated(x, g, module.weight, 1e-5, activation, round_normed_to_input_dtype=round_normed)
    for name, a, b in zip(
        ("x", "g", "weight"), torch.autograd.grad((y * weight).sum(), [x, g, module.weight]), expected
    ):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-6, f"gradient of {name}: relative error {err:.3e}"


def test_float64_stays_float64_and_dispatcher():
    gen = torch.Generator().manual_seed(0)
    x, g, w = (torch.randn(4, D, generator=gen, dtype=torch.float64) for _ in range(3))
    w = w[0]
    y = gated_rms_norm(x, g, w, 1e-6, "silu")
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * g * torch.sigmoid(g)
    assert y.dtype == torch.float64
    assert (y - expected).abs().max().item() < 1e-13


def test_validation():
    x = torch.randn(2, D)
    with pytest.raises(ValueError, match="activation"):
        naive_rms_norm_gated(x, x, torch.ones(D), activation="relu")
    with pytest.raises(ValueError, match="`g`"):
        naive_rms_norm_gated(x, x[:1], torch.ones(D))
    with pytest.raises(ValueError, match="weight"):
        naive_rms_norm_gated(x, x, torch.ones(D + 1))
