"""The planner report: pack a batch of rollout trees, plan its microbatches at `planner.capacity` (for one data-parallel
replica), and show what tree training saves on it."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from app.config import JobConfig
from app.errors import ConfigError
from planner.jsonl import read_jsonl
from planner.microbatch.plan import check_inputs, plan_microbatches
from planner.pack import pack

#: Bundled sample of rollout trees, used when the config names no trajectories.
SAMPLE_TREES = Path(__file__).resolve().parent.parent / "configs" / "data" / "sample_trees.jsonl"


def run_plan_report(config: JobConfig, console: Console | None = None) -> int:
    console = console or Console()
    path = config.rollout.trajectories or str(SAMPLE_TREES)
    trajectories = read_jsonl(path)
    start = time.perf_counter()
    batch = pack(trajectories)
    pack_s = time.perf_counter() - start
    capacity = config.planner.capacity
    try:
        check_inputs(trajectories, capacity, 1)
    except ValueError as e:
        raise ConfigError(f"`planner.capacity` = {capacity} for {path}: {e}") from None
    plan = plan_microbatches(trajectories, capacity, 1)
    table = Table(title=f"Packing {Path(path).name}", show_header=False)
    trees = len({t.tree for t in trajectories})
    rows = [
        ("rollout trees", f"{trees}"),
        ("trajectories", f"{batch.num_trajectories}"),
        ("semantic tokens S", f"{batch.num_semantic:,}"),
        ("compact tokens C", f"{batch.num_compact:,}"),
        ("compression S/C", f"{batch.compression:.3f}x"),
        ("segments", f"{batch.num_segments:,}"),
        ("longest path", f"{batch.max_depth:,}"),
        ("packing time", f"{pack_s * 1e3:.1f} ms"),
        (f"microbatches at capacity {capacity:,}", f"{len(plan.microbatches)}"),
        ("compact tokens planned", f"{plan.total_compact_tokens:,}"),
        ("compression S/planned", f"{batch.num_semantic / plan.total_compact_tokens:.3f}x"),
        ("planning time", f"{plan.planning_seconds * 1e3:.1f} ms"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    return 0
