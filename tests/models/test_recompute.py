"""Selective activation recomputation (`models.recompute`): the layers and parts it chooses, that an op policy
really keeps op outputs (fewer ops run again in backward), exact gradients for every option on the flat forward,
and an ablation: a policy that caches a tensor a kernel then overwrites gives wrong gradients unnoticed by torch.

Tree and carry execution under these options: `tests/models/tree/test_execute.py`,
`tests/parallel/test_carry_runner.py` (both import `OPTIONS`).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import models
from models.recompute import LayerRecompute, SelectiveRecompute
from tests.models.test_decoder import build, cu, ids_for

#: Recompute options every exactness test runs besides False and True (full): one per part, kind filter and
#: every-N, each saving some op group the CPU reference paths call ("mm": their attention and expert matmuls;
#: "experts": the router's top-k), so the op policy takes effect on the CPU too.
OPTIONS = {
    "op": SelectiveRecompute(save=("attention", "experts", "mm")),
    "ffn": SelectiveRecompute(part="ffn", save=("mm",)),
    "linear-mixer": SelectiveRecompute(layers=("linear_attention",), part="mixer", save=("experts", "mm")),
    "every2": SelectiveRecompute(every=2, save=()),
}


def test_per_layer_choice():
    config = models.preset("tiny-kimi-linear")  # linear, linear, linear, full
    op = LayerRecompute("layer", ("attention", "experts"))
    assert SelectiveRecompute().per_layer(config) == [op] * 4
    assert SelectiveRecompute(layers=("full_attention",), part="ffn", save=()).per_layer(config) == [
        None, None, None, LayerRecompute("ffn")]
    assert SelectiveRecompute(every=2).per_layer(config) == [None, op, None, op]
    assert SelectiveRecompute(layers=("linear_attention",), every=3).per_layer(config) == [None, None, op, None]


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": ("moe",)}, "`layers`"), ({"layers": ()}, "`layers` is empty"), ({"part": "block"}, "`part`"),
    ({"every": 0}, "`every`"), ({"save": ("flash",)}, "`save`"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SelectiveRecompute(**kwargs)


class OpCounter(TorchDispatchMode):
    """Counts the calls of each ATen op."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_mm_calls(model, recompute) -> int:
    model.set_activation_checkpointing(recompute)
    out = model(ids_for((40, 9)), cu_seqlens=cu((40, 9)))
    counter = OpCounter()
    with counter:
        out.logits.square().mean().backward()
    return counter.counts.get(torch.ops.aten.mm.default, 0)


def test_op_policy_keeps_the_saved_outputs():
    """In backward, full recomputation runs every forward matmul of the layers again; saving "mm" runs none of them
    again (only the gradient matmuls), recomputing the FFN block alone runs fewer than the whole layer."""
    model = build("tiny-kimi-linear")
    none, full = backward_mm_calls(model, False), backward_mm_calls(model, True)
    saved = backward_mm_calls(model, SelectiveRecompute(save=("mm",)))
    ffn = backward_mm_calls(model, SelectiveRecompute(part="ffn", save=()))
    assert saved == none < ffn < full


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_selective_gives_the_same_gradients(name, option):
    """Flat forward in float64: logits and every gradient as without recomputation (the op policy replays saved
    outputs bit for bit and recomputes the rest with the same kernels)."""
    model = build(name)
    model.to(torch.float64)
    model.keep_upcast_buffers()
    ids, lengths = ids_for((70, 20)), (70, 20)
    results = []
    for recompute in (False, OPTIONS[option]):
        model.zero_grad()
        model.set_activation_checkpointing(recompute)
        out = model(ids, cu_seqlens=cu(lengths))
        stats = [s for s in out.moe_stats if s is not None]
        (out.logits.square().mean() + models.load_balancing_loss(sum(stats[1:], stats[0]))).backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert torch.equal(logits_a, logits_b)
    errors = {n: ((grads_a[n] - grads_b[n]).norm() / grads_a[n].norm().clamp_min(1e-30)).item() for n in grads_a}
    assert max(errors.values()) <= 1e-10, max(errors.items(), key=lambda kv: kv[1])


def test_caching_a_tensor_a_kernel_overwrites_is_wrong():
    """Ablation: a matmul output that a kernel then scales in place (a Triton kernel's write does not bump the
    version counter, simulated through `.data`) must not be saved: the recomputation takes the cached, already
    scaled tensor and scales it again, and the gradient is wrong without an error. No SAVE_GROUPS op feeds such a
    kernel (the fused row-wise kernels and fla's write only into tensors they allocate)."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64)

    def block(x):
        y = x @ w
        y.data.mul_(2.0)  # an in-place kernel write
        return y.sin()

    def saving_mm(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def grad(**kwargs):
        x.grad = None
        out = checkpoint(block, x, use_reentrant=False, **kwargs) if kwargs else block(x)
        out.sum().backward()
        return x.grad.clone()

    expected = grad()
    assert torch.allclose(grad(context_fn=lambda: create_selective_checkpoint_contexts([])), expected)
    wrong = grad(context_fn=lambda: create_selective_checkpoint_contexts(saving_mm))
    assert (wrong - expected).abs().max() > 1e-3
