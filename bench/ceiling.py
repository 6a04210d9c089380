"""The exact-execution ceiling of tree execution (the analysis: docs/history.md, "tree vs trajectory-wise speed and bf16
fidelity at microbatch scale").

A tree microbatch's kernels against an ideal: the flat microbatch's kernel cost per row for everything but full
attention, and per causal query-key pair for flash attention (a tree's pairs shrink less than its rows). The ideal is
what exact tree execution cannot go below with the same kernels; the excess is what tree execution adds (gathers,
scatters, the extra linear-attention calls). `bench.step_profile` prints the split, `bench.speed --ceiling` the
ceiling of the speedup it measured, so that a change which speeds up flat more than the tree stays visible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from models.tree.regions import PREFIX

__all__ = ["NOT_DEVICE_WORK", "KernelWork", "Ideal", "ideal", "is_device_work", "kernel_seconds", "profiled",
           "tree_regions"]


@dataclass(frozen=True)
class KernelWork:
    """One microbatch's work and device time: rows executed, causal query-key pairs of its full attention, kernel
    seconds in all and in flash attention."""

    rows: float
    pairs: float
    kernel_s: float
    flash_s: float


@dataclass(frozen=True)
class Ideal:
    """The tree microbatch at flat's costs: `seconds` in all, of which `flash_s` flash attention."""

    seconds: float
    flash_s: float

    def share_of(self, tree: KernelWork) -> float:
        """How close the tree runs to its ceiling: ideal / measured kernel time (1 = no overhead)."""
        return self.seconds / tree.kernel_s


def ideal(flat: KernelWork, tree: KernelWork) -> Ideal:
    """`tree` at `flat`'s cost per row (everything but flash attention) and per query-key pair (flash)."""
    per_row = (flat.kernel_s - flat.flash_s) / flat.rows
    flash = flat.flash_s / flat.pairs * tree.pairs
    return Ideal(per_row * tree.rows + flash, flash)


#: Device-side records of a profile that are no device work: CUPTI records the host waiting on a full launch queue as
#: "Command Buffer Full" (time the GPU was busy, not more work).
NOT_DEVICE_WORK = frozenset({"Command Buffer Full"})


def is_device_work(e) -> bool:
    """Whether a profile event (or key average) is device work: a kernel or copy, neither a host event, nor the
    device-side span of a `record_function` region (`is_user_annotation`), nor `NOT_DEVICE_WORK`."""
    return (e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
            and e.key not in NOT_DEVICE_WORK)


def kernel_seconds(prof) -> tuple[float, float]:
    """(all device kernels and copies, the flash-attention kernels) of a `torch.profiler` profile, in seconds
    (`is_device_work`)."""
    kernels = [e for e in prof.key_averages() if is_device_work(e)]
    total = sum(e.self_device_time_total for e in kernels)
    flash = sum(e.self_device_time_total for e in kernels if "flash" in e.key)
    return total / 1e6, flash / 1e6


def tree_regions(prof) -> list[tuple[str, float, int]]:
    """Tree execution's own regions (`models.tree.regions`) in a profile: (name, device seconds of the kernels
    launched inside, calls), most device time first."""
    found = [(e.key[len(PREFIX):], e.device_time_total / 1e6, e.count) for e in prof.key_averages()
             if e.device_type == DeviceType.CPU and e.key.startswith(PREFIX)]
    return sorted(found, key=lambda r: -r[1])


def profiled(fn: Callable[[], object], rows: float, pairs: float, record_shapes: bool = False
             ) -> tuple[KernelWork, object]:
    """Run `fn` once under the CUDA profiler (synchronised at the end) -> its KernelWork and the profile."""
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        fn()
        torch.cuda.synchronize()
    kernel_s, flash_s = kernel_seconds(prof)
    return KernelWork(rows, pairs, kernel_s, flash_s), prof
