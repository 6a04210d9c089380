"""bench.step_profile's overhead line: a tree microbatch that costs what flat costs per row and per attention pair
has no overhead; extra time is attributed to flash attention or to the rest."""

from __future__ import annotations

import re

from bench.step_profile import overhead_line

FLAT = {"rows": 1000, "pairs": 4e5, "kernel_s": 3.0, "flash_s": 1.0}  # 2 ms per 1,000 rows + 2.5 ns per pair


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", line)]


def test_tree_at_flat_costs_has_no_overhead():
    tree = {"rows": 500, "pairs": 1e5, "kernel_s": 1.25, "flash_s": 0.25}
    assert numbers(overhead_line(FLAT, tree)) == [1.25, 1.25, 0.0, 0.0, 0.0]


def test_extra_time_is_split_between_flash_and_the_rest():
    tree = {"rows": 500, "pairs": 1e5, "kernel_s": 1.55, "flash_s": 0.35}
    assert numbers(overhead_line(FLAT, tree)) == [1.55, 1.25, 0.3, 0.1, 0.2]
