"""Held carry microbatches park their saved activations in host memory (`parallel.host_offload`): which forwards
do, that selective recomputation keeps no op output past the hooks there, and that a step with every held
microbatch parked still equals trajectory-wise training (float64)."""

from __future__ import annotations

import pytest
import torch

from models.recompute import SelectiveRecompute
from parallel import host_offload
from parallel.host_offload import offloaded_forwards, stays
from parallel.plain_runner import PlainRunner
from tests.models.test_decoder import build
from tests.models.test_recompute import OPTIONS, backward_mm_calls
from tests.models.tree.test_carry_microbatch_layout import step_trees
from tests.models.tree.test_execute import make_model
from tests.parallel.test_carry_runner import TOL, flat_reference, microbatch_loss, prepare, relative_errors

F, B = "forward", "backward"


@pytest.mark.parametrize(("events", "resident", "expected"), [
    ([(F, 0), (F, 1), (B, 1), (B, 0)], 1, set()),
    ([(F, 0), (F, 1), (B, 1), (B, 0)], 0, {0}),
    ([(F, 0), (B, 0), (F, 1), (B, 1)], 0, set()),  # nothing stays open while another runs
    ([(F, 0), (F, 1), (F, 2), (F, 3), (B, 3), (B, 2), (B, 1), (B, 0)], 1, {1, 2}),
    ([(F, 0), (F, 1), (F, 2), (F, 3), (B, 3), (B, 2), (B, 1), (B, 0)], 2, {2}),
    ([(F, 0), (F, 1), (F, 2), (F, 3), (B, 3), (B, 2), (B, 1), (B, 0)], 9, set()),
    # a backward frees its place on the device for the next held forward
    ([(F, 0), (F, 1), (B, 1), (B, 0), (F, 2), (F, 3), (B, 3), (B, 2)], 1, set()),
    # empty events (slot -1) hold nothing and keep no place
    ([(F, 0), (F, -1), (F, 1), (B, 1), (B, -1), (B, 0)], 0, {0}),
    ([(F, -1), (F, 0), (B, 0), (B, -1)], 0, set()),
])
def test_which_forwards_are_offloaded(events, resident, expected):
    assert offloaded_forwards(events, resident) == expected


class RoundTrip:
    """CPU stand-ins for the device <-> host copies: every packed tensor is copied (floating ones scaled by 1.5, for
    the ablation)."""

    def __init__(self, monkeypatch, corrupt=False):
        self.packed = 0
        self.corrupt = corrupt
        monkeypatch.setattr(host_offload, "_pack", self.pack)
        monkeypatch.setattr(host_offload, "_unpack", self.unpack)

    def pack(self, t):
        if stays(t):
            return t
        self.packed += 1
        return ("host", t.detach().clone())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        t = packed[1]
        return 1.5 * t if self.corrupt and t.is_floating_point() else t.clone()


@pytest.mark.parametrize("recompute", [False, True, OPTIONS["op"]], ids=["none", "full", "op"])
def test_every_held_microbatch_offloaded_equals_trajectory_wise(monkeypatch, recompute):
    reference, model = make_model("tiny-kimi-linear", torch.float64), make_model("tiny-kimi-linear", torch.float64)
    trees = step_trees(model.config.chunk_size, model.config.vocab_size)
    step = prepare(trees, model)
    held = offloaded_forwards(step.events, 0)
    assert len(held) >= 2, "the step must keep microbatches open while others run"
    copies = RoundTrip(monkeypatch)
    model.set_activation_checkpointing(recompute)
    result = PlainRunner(model, resident=0).train_step(step, microbatch_loss)
    assert copies.packed > 0
    loss_ref = flat_reference(reference, trees, step)[1]
    loss_ref.backward()
    assert abs(result.loss - loss_ref.item()) <= TOL * abs(loss_ref.item())
    errors = relative_errors(reference, model)
    assert len(errors) == len(list(model.parameters()))
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])


def test_offloaded_activations_are_the_ones_the_backward_reads(monkeypatch):
    """Scaling what comes back from the host breaks the gradients: the offloaded tensors are really used (without
    recomputation: with it, other layer inputs change the recomputed graph and torch's checkpoint refuses it)."""
    reference, model = make_model("tiny-kimi-linear", torch.float64), make_model("tiny-kimi-linear", torch.float64)
    trees = step_trees(model.config.chunk_size, model.config.vocab_size)
    step = prepare(trees, model)
    RoundTrip(monkeypatch, corrupt=True)
    PlainRunner(model, resident=0).train_step(step, microbatch_loss)
    flat_reference(reference, trees, step)[1].backward()
    assert max(relative_errors(reference, model).values()) > 1e-4


def test_selective_keeps_no_op_output_past_the_hooks():
    """Op outputs a selective policy saves live in torch's checkpoint storage, where the hooks cannot park them: a
    forward under host_offload() saves none (its backward runs every forward matmul again, as full recomputation
    does, so all it holds went through the hooks); the same option outside it keeps them."""
    model = build("tiny-kimi-linear")
    option, full = SelectiveRecompute(save=("mm",)), backward_mm_calls(model, True)
    assert backward_mm_calls(model, option) < full
    assert backward_mm_calls(model, option, host_offload.host_offload) == full


def test_resident_must_not_be_negative():
    with pytest.raises(ValueError, match="resident"):
        PlainRunner(make_model("tiny-kimi-linear", torch.float64), resident=-1)


@pytest.mark.parametrize("recompute", [False, True])
def test_parameters_and_their_views_stay(recompute):
    """Of what a carry step saves for backward, `stays` lets go of no parameter, view of one or integer tensor, and
    keeps the weights the forward saves (`F.linear`'s `weight.t()`, the experts' weight slices)."""
    model = make_model("tiny-kimi-linear", torch.float32)
    model.set_activation_checkpointing(recompute)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved, kept = [], []

    def pack(t):
        (kept if stays(t) else moved).append(t)
        return t

    trees = step_trees(model.config.chunk_size, model.config.vocab_size)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        PlainRunner(model, resident=9).train_step(prepare(trees, model), microbatch_loss)
    assert moved and all(t.is_floating_point() for t in moved)
    assert not any(t.untyped_storage().data_ptr() in storages for t in moved)
    assert any(t.untyped_storage().data_ptr() in storages for t in kept), "the forward saves weights (or views)"
