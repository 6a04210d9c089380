"""Saved activations of a microbatch parked in host memory between its forward and its backward (prefix carry).

A carry microbatch whose rows later microbatches read stays open while they run: its backward comes after theirs.
Under full-layer recomputation what it holds is its layer inputs (`[C, D]` per layer: ling-3-tiny 24 x 1,536 bf16,
73.7 KB per row, 4.1 GB at 55,752 rows) and the saved tensors of its embedding, final norm and log-probs. On full
SWE-like steps a replica can have up to 10 microbatches open at once (bench/RESULTS.md), so `PlainRunner` keeps
the activations of at most `resident` open microbatches on the device and moves the others' to pinned host memory
under `host_offload()`, copying them back when autograd unpacks them in the backward.

Selective recomputation's saved op outputs are kept by torch's checkpoint storage, which these hooks never see: under
`host_offload()` a recomputed part saves none (`models.recompute.without_saved_ops`) and recomputes whole from its
inputs, which the hooks park, so the bound holds for every recompute option (the gradients are the same).

Parameters and views of them stay on the device (`stays`), so FSDP2's unsharded parameters are neither copied nor
detached from their resharding; so do integer tensors. What a microbatch exports to later ones, and the gradients
its consumers send back, stay on the device too (`models.tree.carry_exchange.CarryExchange`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from models.recompute import without_saved_ops

__all__ = ["host_offload", "offloaded_forwards", "stays"]


def stays(t: torch.Tensor) -> bool:
    """Device tensors `host_offload` leaves where they are: integer tensors (indices, `cu_seqlens`: small, and fla
    caches per-call data by their identity) and parameters or views of them (`F.linear` saves `weight.t()`, the
    experts slices of their stacked weights)."""
    base = t if t._base is None else t._base
    return not t.is_floating_point() or (base.is_leaf and base.requires_grad)


def _pack(t: torch.Tensor):
    if t.device.type == "cpu" or stays(t):
        return t
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return t.device, host


def _unpack(packed) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


@contextlib.contextmanager
def host_offload() -> Iterator[None]:
    """Context manager: tensors autograd saves inside it (device tensors other than parameters) wait in pinned host
    memory until the backward unpacks them. The copies run on the current stream, so they are ordered with the
    kernels that produce and later read them; CPU tensors are kept as they are. Recomputed layer parts keep no op
    outputs inside it (they would bypass the hooks): they recompute whole."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack), without_saved_ops():
        yield


def offloaded_forwards(events: Sequence[tuple[str, int]], resident: int) -> frozenset[int]:
    """The slots whose forward runs under `host_offload()`: a microbatch that stays open while another forward runs
    (its backward is not its next event of its own) keeps its activations on the device only while fewer than
    `resident` such open microbatches already do. Slot -1 (an empty event) holds nothing.

    With the carry planner's nested events (F0 F1 .. Fk Bk .. B0) the first `resident` open ones stay: they are
    the ones whose rows the later ones read. `resident` = 0 offloads every held microbatch; a large one none."""
    held = set()  # a slot forwards once per step
    for i, (kind, slot) in enumerate(events):
        if kind != "forward" or slot < 0:
            continue
        later = events[i + 1:]
        own_backward = later.index(("backward", slot)) if ("backward", slot) in later else len(later)
        if any(k == "forward" and s >= 0 for k, s in later[:own_backward]):
            held.add(slot)
    on_device: set[int] = set()
    offloaded: set[int] = set()
    for kind, slot in events:
        if slot < 0:
            continue
        if kind == "forward" and slot in held:
            (on_device if len(on_device) < resident else offloaded).add(slot)
        elif kind == "backward":
            on_device.discard(slot)
    return frozenset(offloaded)
