"""A layout's many small host tensors moved to one device in one host-to-device copy per dtype, as views of one
buffer.

A layout holds hundreds of small index tensors (per linear-attention kernel call, per branch group). A copy from
pageable host memory blocks the host until the device has it, so one copy each would cost one round trip each, and
would leave the device idle while the host builds the next tensor between them. Layouts are therefore built on the
host and moved once (`to_device`): on CUDA from pinned memory without blocking, so the host goes on to launch the
step's kernels. The same code runs on the host (one concatenation), so the CPU tests read the views' values. Every
view starts on a 16-byte boundary, as a tensor of its own would: Triton specialises pointer arguments on that
alignment, and a misaligned pointer would compile another kernel variant.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["ALIGN_BYTES", "HOST_SUFFIX", "device_views", "to_device"]

ALIGN_BYTES = 16
HOST_SUFFIX = "_cpu"
"""A dataclass field whose name ends so holds a tensor that stays on the host (e.g. `cu_seqlens_cpu`, read by
kernels' launch code without a device synchronisation)."""

T = TypeVar("T")


def device_views(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """The tensors on `device` (None: the host), same shapes and dtypes, each a contiguous view of one buffer per
    dtype. To CUDA the buffer is copied from pinned memory without blocking the host (torch keeps the pinned block
    until the copy has run)."""
    device = torch.device("cpu" if device is None else device)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[t.dtype].append(i)
    for dtype, members in by_dtype.items():
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        sizes = [-(-tensors[i].numel() // align) * align for i in members]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
        start = 0
        for i, size in zip(members, sizes):
            host[start : start + tensors[i].numel()] = tensors[i].reshape(-1)
            start += size
        flat = host.to(device, non_blocking=True)
        for i, part in zip(members, flat.split(sizes)):
            out[i] = part[: tensors[i].numel()].view(tensors[i].shape)
    return out


def _map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """`obj` rebuilt with `fn` applied to every tensor in it: through dataclass fields (those set by `__init__`;
    fields ending in `HOST_SUFFIX` are kept as they are), lists, tuples and dict values, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)
                   if f.init and not f.name.endswith(HOST_SUFFIX)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(x, fn) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def to_device(obj: T, device) -> T:
    """A copy of `obj` (a layout: dataclasses, lists, tuples, dicts of tensors and host values) whose tensors are on
    `device`, moved by one `device_views` (host-suffixed fields stay on the host)."""
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    moved = iter(device_views(found, device))
    return _map_tensors(obj, lambda t: next(moved))
