"""bench.ceiling's ideal and bench.step_profile's overhead line: a tree microbatch that costs what flat costs per row
and per attention pair has no overhead; extra time is attributed to flash attention or to the rest; bench.speed
prints the ceiling it measured."""

from __future__ import annotations

import re

from bench.ceiling import KernelWork, ideal
from bench.speed import ceiling_line, ceiling_of
from bench.step_profile import overhead_line

FLAT = KernelWork(rows=1000, pairs=4e5, kernel_s=3.0, flash_s=1.0)  # 2 ms per 1,000 rows + 2.5 ns per pair


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", line)]


def test_tree_at_flat_costs_has_no_overhead():
    tree = KernelWork(rows=500, pairs=1e5, kernel_s=1.25, flash_s=0.25)
    assert overhead_line(FLAT, tree, "carry").startswith("carry kernels 1.250 s;")
    assert numbers(overhead_line(FLAT, tree, "tree")) == [1.25, 1.25, 0.0, 0.0, 0.0]
    assert ideal(FLAT, tree).share_of(tree) == 1.0


def test_extra_time_is_split_between_flash_and_the_rest():
    tree = KernelWork(rows=500, pairs=1e5, kernel_s=1.55, flash_s=0.35)
    assert numbers(overhead_line(FLAT, tree, "tree")) == [1.55, 1.25, 0.3, 0.1, 0.2]
    assert abs(ideal(FLAT, tree).share_of(tree) - 1.25 / 1.55) < 1e-12


def test_speed_prints_the_ceiling():
    """An earlier H200 run's numbers: tree kernels 5.071 s against 4.780 s ideal, F/B/Grad 4.28x: 0.94 of a 4.54x
    ceiling."""
    share = 4.780 / 5.071
    line = ceiling_line("swe", {"tree_kernel_s": 5.071, "ideal_s": 4.780, "share": share,
                                "ceiling_speedup": 4.28 / share})
    assert numbers(line) == [5.071, 4.780, 0.94, 4.54]


def test_carry_ceiling_is_the_whole_step_against_flat_costs():
    """H200 numbers: a carry step (9.420 s of kernels for 111,505 rows and 3.150e9 pairs, 9.96 s timed) against
    the fullest flat microbatch of the same workload (64,268 rows, 1.0326e9 pairs, 4.165 s of which flash 1.154 s)
    and its flat step (80.41 s): ideal 8.74 s, share 0.93, ceiling 8.70x."""
    flat = KernelWork(rows=64_268, pairs=1.0326e9, kernel_s=4.165, flash_s=1.154)
    carry = KernelWork(rows=111_505, pairs=3.150e9, kernel_s=9.420, flash_s=3.751)
    e = ceiling_of(flat, carry, 80.41 / 9.96)
    assert abs(e["ideal_s"] - 8.744) < 5e-3 and abs(e["share"] - 0.928) < 1e-3
    assert abs(e["ceiling_speedup"] - 80.41 / 9.96 / e["share"]) < 1e-12
    line = ceiling_line("swe", e, "carry")
    assert "whole carry step" in line and "the carry runs at 0.93 of its ceiling" in line


def test_the_kernel_table_leaves_out_device_spans_of_regions():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.step_profile import without_annotation_spans

    events = [SimpleNamespace(key="arbor: branch view gather", device_type=DeviceType.CPU, is_user_annotation=True),
              SimpleNamespace(key="arbor: branch view gather", device_type=DeviceType.CUDA, is_user_annotation=True),
              SimpleNamespace(key="flash_fwd_kernel", device_type=DeviceType.CUDA, is_user_annotation=False)]
    kept = without_annotation_spans(events)
    assert [(e.key, e.device_type) for e in kept] == [("arbor: branch view gather", DeviceType.CPU),
                                                      ("flash_fwd_kernel", DeviceType.CUDA)]
