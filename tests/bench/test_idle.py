"""bench.idle: the device's idle time in a profile, before the first kernel and between kernels, with the host ops
running at each gap's ends; bench.ceiling.kernel_seconds leaves out the records that are no device work, and
bench.ceiling.tree_regions finds tree execution's own regions (models.tree.regions) in a profile."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.ceiling import kernel_seconds, tree_regions
from bench.idle import device_idle, profile_idle
from models.tree import regions
from models.tree.attention import tree_attention
from models.tree.row_gather import RowGather
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.models.tree.test_attention import segment_order_layout

HOST = [(0.0, 5000.0, "step"), (1000.0, 1400.0, "aten::item"), (1100.0, 1300.0, "cudaStreamSynchronize"),
        (3000.0, 3100.0, "aten::mm")]


def test_leading_time_and_gaps_longest_first_with_their_host_ops():
    kernels = [(200.0, 1000.0), (500.0, 1050.0), (1400.0, 3000.0), (3050.0, 4900.0)]
    idle = device_idle(kernels, HOST, (0.0, 5000.0), min_gap_us=100.0)
    assert idle.leading_s == pytest.approx(200e-6)
    assert idle.seconds == pytest.approx((200 + 350 + 50 + 100) * 1e-6)  # overlapping kernels are merged
    assert [(g.start_us, g.seconds) for g in idle.gaps] == [(1050.0, pytest.approx(350e-6))]  # the 50 us gap is short
    gap = idle.gaps[0]
    assert gap.host_at_start == "step / aten::item" and gap.host_at_end == "step"
    assert "350.00 ms" not in idle.describe() and "0.35 ms" in idle.describe()


def test_a_window_without_device_work_is_all_idle():
    idle = device_idle([], HOST, (0.0, 5000.0))
    assert (idle.seconds, idle.leading_s, idle.gaps) == (pytest.approx(5e-3), pytest.approx(5e-3), [])


def test_every_gap_is_named_and_summed_by_its_host_ops():
    kernels = [(0.0, 100.0), (300.0, 400.0), (1300.0, 1500.0), (3050.0, 3200.0)]
    idle = device_idle(kernels, HOST, (0.0, 3200.0))
    assert [(g.seconds, g.host_at_start, g.host_at_end) for g in idle.gaps] == [
        (pytest.approx(1.55e-3), "step", "step / aten::mm"), (pytest.approx(0.9e-3), "step", "step / aten::item"),
        (pytest.approx(2e-4), "step", "step")]
    assert idle.summed_by("host_at_start") == [("step", pytest.approx(2.65), 3)]
    assert [name for name, _, _ in idle.summed_by("host_at_end")] == ["step / aten::mm", "step / aten::item", "step"]
    assert "gaps by the host op at their end" in idle.describe()


def event(name, start, end, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, key=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           self_device_time_total=end - start)


class FakeProfile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events

    def key_averages(self):
        return self._events


def test_a_full_launch_queue_and_annotation_spans_are_not_device_work():
    annotation = event("tree: branch views", 0.0, 2000.0)
    annotation.is_user_annotation = True
    prof = FakeProfile([event("aten::mm", 0.0, 2000.0, DeviceType.CPU), event("gemm", 100.0, 900.0),
                        event("Command Buffer Full", 900.0, 1500.0), event("flash_fwd_kernel", 1500.0, 2000.0),
                        annotation])
    assert kernel_seconds(prof) == (pytest.approx(1.3e-3), pytest.approx(0.5e-3))
    idle = profile_idle(prof, min_gap_us=100.0)
    assert idle.leading_s == pytest.approx(1e-4)
    assert [(g.start_us, g.seconds, g.host_at_start) for g in idle.gaps] == [(900.0, pytest.approx(6e-4), "aten::mm")]


def test_tree_regions_are_profiled_on_the_cpu_and_cost_nothing_unprofiled():
    """The branch views' regions appear once per group and pass (forward gathers, attention; backward gathers,
    attention, scatter-add; no gather or scatter for a group without ancestors), the row gathers' forward and
    backward too; without a profiler no range is opened."""
    trunk = list(range(1, 9))
    batch = pack([Trajectory(np.array(trunk + tail)) for tail in ([20, 21], [30], [40, 41, 42])])
    _, layout = segment_order_layout(batch, 0, max_view_rows=4)
    C = batch.num_compact
    qkv = [torch.randn(C, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    gather = RowGather.build(np.arange(C)[::-1], C)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = tree_attention(*qkv, layout, 0.5, "branch")
        (gather(out) ** 2).sum().backward()
    counts = {k: n for k, _, n in tree_regions(prof)}
    groups = len(layout.groups)
    gathered = sum(not g.own_rows for g in layout.groups)  # groups without ancestors read their rows in place
    assert groups > gathered >= 2
    assert counts == {"branch view gather": 2 * gathered, "branch view attention": groups,
                      "branch view attention backward": groups, "branch view scatter-add": gathered,
                      "row gather": 1, "row gather backward": 1}
    opened = []
    real = regions.record_function
    regions.record_function = lambda name: opened.append(name) or real(name)
    try:
        tree_attention(*qkv, layout, 0.5, "branch").sum().backward()
    finally:
        regions.record_function = real
    assert opened == []
