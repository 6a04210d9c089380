"""Many small host tensors moved to one device in one host-to-device copy per dtype, as views of one buffer.

A layout holds hundreds of small index tensors (per linear-attention kernel call, per branch group). A copy from
pageable host memory blocks the host until the device has it, so one copy each would cost one round trip each. The
same code runs on the host (one concatenation), so the CPU tests read the views' values. Every view starts on a
16-byte boundary, as a tensor of its own would: Triton specialises pointer arguments on that alignment, and a
misaligned pointer would compile another kernel variant.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

__all__ = ["ALIGN_BYTES", "device_views"]

ALIGN_BYTES = 16


def device_views(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """The tensors on `device` (None: the host), same shapes and dtypes, each a contiguous view of one buffer per
    dtype."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[t.dtype].append(i)
    for dtype, members in by_dtype.items():
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        sizes = [-(-tensors[i].numel() // align) * align for i in members]
        host = torch.zeros(sum(sizes), dtype=dtype)
        start = 0
        for i, size in zip(members, sizes):
            host[start : start + tensors[i].numel()] = tensors[i].reshape(-1)
            start += size
        flat = host.to("cpu" if device is None else device)
        for i, part in zip(members, flat.split(sizes)):
            out[i] = part[: tensors[i].numel()].view(tensors[i].shape)
    return out
