"""Where the GPU waits for the host in a profiled step: the intervals in which no kernel or copy runs.

`bench.step_profile` prints "timed run - kernels" (wall time minus device time). This module says where that time
lies: the idle time before the first kernel (host preparation), and each gap between kernels with the host ops
running at its start (what the host was doing when the GPU ran dry, e.g. a synchronising `aten::item` or numpy work
between two ops) and at its end (the op whose launch ended it).

Times are in microseconds of the profiler's clock (host events and device activities share it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.autograd import DeviceType

from bench.ceiling import is_device_work

__all__ = ["Gap", "IdleTime", "device_idle", "profile_idle"]

Interval = tuple[float, float]
"""[start, end) in microseconds."""


@dataclass(frozen=True)
class Gap:
    """One interval with nothing running on the device: its start (us after the window's) and length (s), and the
    host ops (outermost / innermost names) running at its start and at its end ("-" for none: Python between ops;
    "?" when not looked up)."""

    start_us: float
    seconds: float
    host_at_start: str
    host_at_end: str


@dataclass(frozen=True)
class IdleTime:
    """Device idle time over a window: in all, before the first device activity, and the gaps after it of at least
    the minimum length (longest first)."""

    seconds: float
    leading_s: float
    gaps: list[Gap]

    def describe(self, top: int = 5) -> str:
        """The totals, the `top` longest gaps, and the gaps' time summed by the host op at their end (the launch that
        ended them) and at their start (what the host was in when the device ran dry), `top` each."""
        counted = sum(g.seconds for g in self.gaps)
        lines = [f"device idle {self.seconds:.3f} s: {self.leading_s:.3f} s before the first kernel, "
                 f"{len(self.gaps)} gaps after it hold {counted:.3f} s"]
        for g in self.gaps[:top]:
            lines.append(f"  {g.seconds * 1e3:8.2f} ms at +{g.start_us / 1e6:.3f} s: host in {g.host_at_start}, "
                         f"until {g.host_at_end}")
        for title, key in (("end", "host_at_end"), ("start", "host_at_start")):
            lines.append(f"  gaps by the host op at their {title} (ms, gaps):")
            lines.extend(f"  {ms:8.2f} {n:5d}  {name}" for name, ms, n in self.summed_by(key)[:top])
        return "\n".join(lines)

    def summed_by(self, key: str) -> list[tuple[str, float, int]]:
        """(host op, milliseconds, gaps) of the gaps grouped by `key` ("host_at_end" or "host_at_start"), most
        time first."""
        total, count = defaultdict(float), defaultdict(int)
        for g in self.gaps:
            total[getattr(g, key)] += g.seconds * 1e3
            count[getattr(g, key)] += 1
        return sorted(((name, ms, count[name]) for name, ms in total.items()), key=lambda row: -row[1])


def _union(intervals: Sequence[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _host_ops_at(times: np.ndarray, host_ops: Sequence[tuple[float, float, str]]) -> list[str]:
    """For each time t, `outermost / innermost` of the host ops whose interval holds t, "-" when none does."""
    if not host_ops:
        return ["-"] * len(times)
    start = np.array([op[0] for op in host_ops])
    end = np.array([op[1] for op in host_ops])
    names = []
    for t in times:
        holding = np.flatnonzero((start <= t) & (t < end))
        if not holding.size:
            names.append("-")
            continue
        by_start = holding[np.lexsort((-end[holding], start[holding]))]  # earliest start first, longest first on ties
        outer, inner = host_ops[by_start[0]][2], host_ops[by_start[-1]][2]
        names.append(outer if outer == inner else f"{outer} / {inner}")
    return names


def device_idle(device: Sequence[Interval], host_ops: Sequence[tuple[float, float, str]], window: Interval,
                min_gap_us: float = 100.0) -> IdleTime:
    """Idle device time within `window` given the device activities' intervals and the host ops' (start, end, name).

    The gaps listed are those after the first device activity of at least `min_gap_us`, longest first, each with
    the host ops at its ends. `seconds` counts all idle time, shorter gaps and the leading one included."""
    t0, t1 = window
    busy = [(max(s, t0), min(e, t1)) for s, e in _union(device) if e > t0 and s < t1]
    if not busy:
        return IdleTime((t1 - t0) / 1e6, (t1 - t0) / 1e6, [])
    idle = (t1 - t0) - sum(e - s for s, e in busy)
    spans = sorted(((prev_end, start) for (_, prev_end), (start, _) in zip(busy, busy[1:])
                    if start - prev_end >= min_gap_us), key=lambda span: span[0] - span[1])
    names = _host_ops_at(np.array([s for s, _ in spans] + [e for _, e in spans]), host_ops)  # starts, then ends
    gaps = [Gap(s - t0, (e - s) / 1e6, a, b) for (s, e), a, b in zip(spans, names[:len(spans)], names[len(spans):])]
    return IdleTime(idle / 1e6, (busy[0][0] - t0) / 1e6, gaps)


def profile_idle(prof, min_gap_us: float = 100.0) -> IdleTime:
    """`device_idle` of a `torch.profiler` profile, from its first host op (pure-Python work before it is not seen)
    to its last device activity or host op; only `bench.ceiling.is_device_work` keeps the device busy (not the
    "Command Buffer Full" records of a host blocked on the launch queue, nor the device spans of annotations)."""
    device, host = [], []
    for e in prof.events():
        interval = (e.time_range.start, e.time_range.end)
        if e.device_type == DeviceType.CPU:
            host.append((*interval, e.name))
        elif is_device_work(e):
            device.append(interval)
    if not host:
        return IdleTime(0.0, 0.0, [])
    t0 = min(s for s, _, _ in host)
    t1 = max([e for _, e in device] + [max(e for _, e, _ in host)])
    return device_idle(device, host, (t0, t1), min_gap_us)
