"""Named regions of tree execution's own work (what flat execution does not do), for `torch.profiler`.

`region("branch view gather")` marks the ops inside it as a `record_function` range named `arbor: ...` while a
profiler records, and costs nothing otherwise. `bench.step_profile` prints each region's device time, so the tree's
overhead over flat (`bench.ceiling`) is split by its sources: the branch views' gathers, flash calls and
scatter-adds, the linear-attention row gathers and the carried context.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["PREFIX", "region"]

PREFIX = "arbor: "


def region(name: str) -> contextlib.AbstractContextManager:
    """A profiler range `PREFIX + name` while a profiler records, else a no-op context."""
    return record_function(PREFIX + name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
