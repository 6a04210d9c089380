"""Selective activation recomputation (`models.recompute`): the layers and parts it chooses, that the save groups
name real ops and the policy matches them, that an op policy really keeps op outputs (fewer ops run again in
backward; none kept inside `without_saved_ops`), exact gradients for every option on the flat forward, that no
saved op output is written in place after it was made, and the command-line option syntax.

Tree and carry execution under these options: `tests/models/tree/test_execute.py`,
`tests/parallel/test_carry_runner.py` (both import `OPTIONS`).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import models
from models import recompute
from models.recompute import (
    SAVE_GROUPS,
    LayerRecompute,
    SelectiveRecompute,
    parse_recompute_option,
    save_ops,
    without_saved_ops,
)
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
    op = LayerRecompute("layer", ("attention",))
    assert SelectiveRecompute().per_layer(config) == [op] * 4
    assert SelectiveRecompute(layers=("full_attention",), part="ffn", save=()).per_layer(config) == [
        None, None, None, LayerRecompute("ffn")]
    assert SelectiveRecompute(every=2).per_layer(config) == [None, op, None, op]
    assert SelectiveRecompute(layers=("linear_attention",), every=3).per_layer(config) == [None, None, op, None]


def test_every_counts_the_chosen_kinds():
    """`every` = N picks the N-th, 2N-th, ... layer of the kinds in `layers` (ling-3-tiny: 3 linear-attention
    layers, then one full-attention layer, six times); a choice of no layer is an error."""
    config = models.preset("ling-3-tiny")
    chosen = lambda **kw: [i for i, c in enumerate(SelectiveRecompute(**kw).per_layer(config)) if c]  # noqa: E731
    linear = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert len(linear) == 18 and full == [3, 7, 11, 15, 19, 23]
    assert chosen(layers=("linear_attention",), every=4) == [linear[3], linear[7], linear[11], linear[15]]
    assert chosen(layers=("full_attention",), every=2) == [7, 15, 23]
    assert chosen(every=6) == [5, 11, 17, 23]
    with pytest.raises(ValueError, match=r"`every` = 7 selects no layer: the model has 6 layer\(s\) of the kinds "
                                         r"in `layers` \['full_attention'\]"):
        SelectiveRecompute(layers=("full_attention",), every=7).per_layer(config)


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": ("moe",)}, "`layers`"), ({"layers": ()}, "`layers` is empty"), ({"part": "block"}, "`part`"),
    ({"every": 0}, "`every`"), ({"every": True}, "`every` must be an integer"), ({"every": 2.0}, "`every`"),
    ({"save": ("flash",)}, "`save`"),
    ({"layers": "full_attention"}, r"`layers` must be a list, got the string 'full_attention': write \['full"),
    ({"save": "attention"}, "`save` must be a list"),
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


def backward_mm_calls(model, recompute, forward_context=contextlib.nullcontext) -> int:
    model.set_activation_checkpointing(recompute)
    with forward_context():
        out = model.flat_forward(ids_for((40, 9)), cu_seqlens=cu((40, 9)))
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
    assert backward_mm_calls(model, SelectiveRecompute(save=("mm",)), without_saved_ops) == full


class _SavesMoreInsideAPart(torch.autograd.Function):
    """sin(x x^T) that, like the KDA cores (`models.ops.kda`), saves an intermediate for its backward (before its
    other saved tensor, as fla's do) only inside a recomputed part and computes it again in backward otherwise."""

    @staticmethod
    def forward(ctx, x):
        xx = x @ x.T
        ctx.kept = recompute.in_recomputed_part()
        ctx.save_for_backward(xx, x) if ctx.kept else ctx.save_for_backward(x)
        return xx.sin()

    @staticmethod
    def backward(ctx, dy):
        *kept, x = ctx.saved_tensors
        dxx = dy * (kept[0] if ctx.kept else x @ x.T).cos()
        return (dxx + dxx.T) @ x


@pytest.mark.parametrize("save", [(), ("mm",)], ids=["whole", "op policy"])
@pytest.mark.parametrize("scope", [contextlib.nullcontext, without_saved_ops])
def test_in_recomputed_part_in_both_passes_of_a_part(save, scope):
    """`in_recomputed_part()` is true in a part's forward and in backward's recomputation of it, false outside, with
    or without an op policy; an op that saves more inside a part saves the same in both passes (torch's checkpoint
    checks their number and shapes) and gets the same gradient."""
    seen = []

    def part(x):
        seen.append(recompute.in_recomputed_part())
        return _SavesMoreInsideAPart.apply(x) @ x  # the product's saved tensors come after the op's

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with scope():
        y = LayerRecompute("layer", save).run(part, x)
        assert seen == [True] and not recompute.in_recomputed_part()
        y.sum().backward()
    assert seen == [True, True] and not recompute.in_recomputed_part()
    reference = torch.autograd.grad((_SavesMoreInsideAPart.apply(x) @ x).sum(), x)[0]
    assert torch.allclose(x.grad, reference, rtol=1e-13)


def test_save_groups_name_ops_of_this_torch():
    """Every name in SAVE_GROUPS is an op of this torch (an ATen op overload or the flex-attention higher-order op)
    or a custom op `models` registers on import (`arbor::fa4_varlen_forward`), so a misspelt or removed op cannot
    hide in a group."""
    for group, names in SAVE_GROUPS.items():
        for name in names:
            if name == "flex_attention":
                op = torch._higher_order_ops.flex_attention
            else:
                op = functools.reduce(getattr, name.split("."), torch.ops)
            assert str(op) == name, (group, name, str(op))


@pytest.mark.parametrize("group, op", [
    ("attention", torch.ops.aten._flash_attention_forward.default),
    ("attention", torch.ops.arbor.fa4_varlen_forward.default),
    ("attention", torch._higher_order_ops.flex_attention),
    ("experts", torch.ops.aten._grouped_mm.default),
    ("mm", torch.ops.aten.addmm.default),
])
def test_policy_saves_the_ops_of_its_groups(group, op):
    """The policy of `save` = (group,) keeps `op` (the kernels flat and tree execution call on CUDA: matched by name,
    as the checkpoint hands them to the policy) and recomputes the ops of the other groups and the rest."""
    policy = recompute._policy((group,))
    assert policy(None, op) == CheckpointPolicy.MUST_SAVE
    others = [n for g, names in SAVE_GROUPS.items() if g != group for n in names if n != "flex_attention"]
    for name in others + ["aten.empty.memory_format", "aten.add.Tensor"]:
        assert policy(None, functools.reduce(getattr, name.split("."), torch.ops)) == CheckpointPolicy.PREFER_RECOMPUTE
    assert save_ops(("attention", "mm")) == SAVE_GROUPS["attention"] | SAVE_GROUPS["mm"]


@pytest.mark.parametrize("save, forward_calls", [(("attention",), 1), ((), 2)], ids=["attention", "nothing"])
def test_fa4_forward_is_kept_by_the_attention_group(save, forward_calls, monkeypatch):
    """FlashAttention-4's forward (a custom op, run inside the attention Function) runs once when "attention" is
    saved and again in backward otherwise; the gradients are the same. Its kernel is faked by the reference on the
    CPU (FlashAttention-4 needs a Hopper GPU); the op, the Function and the policy are the real ones."""
    import models.ops.varlen_attention.fa4 as fa4
    import models.ops.varlen_attention.function as function
    from models.ops.varlen_attention.naive import naive_varlen_backward, naive_varlen_forward

    calls = []

    class FakeInterface:
        @staticmethod
        def _flash_attn_fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                            causal, return_lse):
            calls.append(q.shape)
            return naive_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale)

    monkeypatch.setattr(fa4, "fa4_interface", lambda: FakeInterface)
    monkeypatch.setattr(function, "varlen_kernels", lambda x, pair: (fa4.fa4_varlen_forward, naive_varlen_backward))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    cu_ = torch.tensor([0, 4, 11])

    def block(q_, k_, v_):
        return function.varlen_attention(q_ * 2, k_, v_, cu_, cu_, 7, 7, 0.5).sin()

    out = LayerRecompute(save=save).run(block, q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(calls) == forward_calls
    expected = torch.autograd.grad(block(q, k, v).sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


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
    for checkpointing in (False, OPTIONS[option]):
        model.zero_grad()
        model.set_activation_checkpointing(checkpointing)
        out = model.flat_forward(ids, cu_seqlens=cu(lengths))
        stats = [s for s in out.moe_stats if s is not None]
        (out.logits.square().mean() + models.load_balancing_loss(sum(stats[1:], stats[0]))).backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert torch.equal(logits_a, logits_b)
    errors = {n: ((grads_a[n] - grads_b[n]).norm() / grads_a[n].norm().clamp_min(1e-30)).item() for n in grads_a}
    assert max(errors.values()) <= 1e-10, max(errors.items(), key=lambda kv: kv[1])


class SavedOutputWatch(TorchDispatchMode):
    """Records the floating outputs of the ops of `names` with their version counters when made."""

    def __init__(self, names: frozenset[str]):
        super().__init__()
        self.names, self.made = names, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in self.names:
            self.made += [(str(func), t, t._version) for t in (out if isinstance(out, tuple) else (out,))
                          if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return out


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_saved_op_outputs_are_not_written_after_they_are_made(name):
    """A saved op output that a later op (or kernel) of our layers wrote into in place would be handed back
    overwritten by the recomputation: after a forward and backward saving every group, each output of a saved op
    still has the version it was made with (CPU reference paths: the "mm" and "experts" groups' ops)."""
    model = build(name)
    model.set_activation_checkpointing(SelectiveRecompute(save=tuple(SAVE_GROUPS)))
    watch = SavedOutputWatch(save_ops(tuple(SAVE_GROUPS)))
    with watch:
        out = model.flat_forward(ids_for((40, 9)), cu_seqlens=cu((40, 9)))
        out.logits.square().mean().backward()
    assert len(watch.made) > 10
    changed = [(op, tuple(t.shape)) for op, t, version in watch.made if t._version != version]
    assert not changed, changed


@pytest.mark.parametrize("text, expected", [
    ("none", False), ("full", True), ("selective", SelectiveRecompute()),
    ("selective:part=ffn,save=experts+attention", SelectiveRecompute(part="ffn", save=("experts", "attention"))),
    ("selective:layers=linear_attention,every=2,save=",
     SelectiveRecompute(layers=("linear_attention",), every=2, save=())),
])
def test_parse_recompute_option(text, expected):
    assert parse_recompute_option(text) == expected


@pytest.mark.parametrize("text, match", [
    ("some", "give none, full or selective"), ("selective:parts=ffn", "key among"),
    ("selective:every=x", "positive integer"), ("selective:save=flash", "`save` entries"),
    ("selective:every=2,part=ffn,every=3", "got 'every' twice"),
])
def test_bad_recompute_option(text, match):
    with pytest.raises(ValueError, match=match):
        parse_recompute_option(text)
