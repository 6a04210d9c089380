"""Microbatch planner benchmark: Arbor (planner.microbatch) against the peer baselines (planner.baselines).

    python -m bench.planner [--steps 10] [--dp 4] [--capacity 65536] [--workload swe] [--scale 1.0] [--markdown]

For each generated step (bench.workloads, seeds 0..steps-1) every planner plans the same trajectories; we report
compact work (HARTS Table 2), planning time (wall and CPU seconds, one process), scheduled slots, and DP-replica
imbalance (HARTS eq. 23, I = max_d w_d / mean_d w_d - 1): within each slot (P50 and P95 over all slots of all steps)
and of the step totals (P50 and max over steps) (HARTS Table 3). Ratios are baseline / Arbor.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import numpy as np

from bench.workloads import swe_like_step, tau2_like_step
from planner.baselines import BASELINES
from planner.microbatch import MicrobatchPlan, plan_microbatches

__all__ = ["imbalance", "main"]


def imbalance(work: np.ndarray) -> np.ndarray:
    """HARTS eq. 23 per row of `work` [rows, D]: max / mean - 1 (0 for an all-zero row)."""
    mean = work.mean(axis=1)
    return np.where(mean > 0, work.max(axis=1) / np.maximum(mean, 1e-12) - 1, 0.0)


def _run(name: str, trajectories, capacity: int, dp: int, ortools_time_limit: float) -> tuple[MicrobatchPlan, float]:
    cpu = time.process_time()
    if name == "arbor":
        plan = plan_microbatches(trajectories, capacity, dp)
    elif name == "ortools":
        plan = BASELINES[name](trajectories, capacity, dp, time_limit=ortools_time_limit)
    else:
        plan = BASELINES[name](trajectories, capacity, dp)
    return plan, time.process_time() - cpu


def _check(plan: MicrobatchPlan, n: int, capacity: int, dp: int) -> None:
    covered = sorted(i for mb in plan.microbatches for i in mb.trajectories)
    if covered != list(range(n)):
        raise AssertionError(f"{plan.method}: trajectories not covered exactly once")
    if any(not mb.trajectories or mb.compact_tokens > capacity for mb in plan.microbatches):
        raise AssertionError(f"{plan.method}: an empty or over-capacity microbatch")
    if len(plan.microbatches) % dp:
        raise AssertionError(f"{plan.method}: K is not a multiple of dp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=65_536)
    parser.add_argument("--workload", choices=("swe", "tau2"), default="swe")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the paths of a full step")
    parser.add_argument("--ortools-time-limit", type=float, default=10.0, help="CP-SAT seconds per replica")
    parser.add_argument("--methods", default="arbor," + ",".join(BASELINES), help="comma-separated planners")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m != "arbor" and m not in BASELINES]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; choose from arbor, {', '.join(BASELINES)}")
    make = swe_like_step if args.workload == "swe" else tau2_like_step
    print("command: python -m bench.planner " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"config: workload={args.workload} steps={args.steps} dp={args.dp} capacity={args.capacity} "
          f"scale={args.scale} ortools_time_limit={args.ortools_time_limit}s/replica methods={','.join(methods)}")

    rows = []
    stats = {m: {"work": 0, "wall": 0.0, "cpu": 0.0, "slots": 0, "slot_imb": [], "step_imb": []} for m in methods}
    for seed in range(args.steps):
        trajectories = make(seed, scale=args.scale)
        raw = sum(len(t) for t in trajectories)
        row = {"step": seed, "paths": len(trajectories), "raw": raw}
        for m in methods:
            plan, cpu = _run(m, trajectories, args.capacity, args.dp, args.ortools_time_limit)
            _check(plan, len(trajectories), args.capacity, args.dp)
            w = plan.slot_work()
            s = stats[m]
            s["work"] += plan.total_compact_tokens
            s["wall"] += plan.planning_seconds
            s["cpu"] += cpu
            s["slots"] += plan.num_slots
            s["slot_imb"].append(imbalance(w))
            s["step_imb"].append(float(imbalance(w.sum(axis=0, keepdims=True))[0]))
            row[m] = (plan.total_compact_tokens, plan.planning_seconds, cpu, plan.method)
        rows.append(row)
        print(f"step {seed}: {row['paths']} paths, {raw:,} raw tokens; " + "; ".join(
            f"{m} {row[m][0]:,} ({row[m][1]:.2f} s)" for m in methods), flush=True)
        del trajectories

    ref = "ortools" if "ortools" in methods else methods[-1]
    print()
    print(f"Per step (compact work; ratio = {ref} / arbor):" if "arbor" in methods else "Per step:")
    head = ["step", "paths", "raw tokens"] + [f"{m} compact" for m in methods]
    if "arbor" in methods and ref != "arbor":
        head += [f"compact {ref}/arbor", f"time {ref}/arbor"]
    print(_line(head, args.markdown, header=True))
    for row in rows:
        cells = [str(row["step"]), f"{row['paths']:,}", f"{row['raw']:,}"] + [f"{row[m][0]:,}" for m in methods]
        if "arbor" in methods and ref != "arbor":
            cells += [f"{row[ref][0] / row['arbor'][0]:.4f}x", f"{row[ref][1] / row['arbor'][1]:.1f}x"]
        print(_line(cells, args.markdown))
    print()
    print("Summary over all steps (imbalance: HARTS eq. 23, in %):")
    head = ["method", "compact tokens", "vs arbor", "plan wall s (mean)", "plan cpu s (mean)", "slots",
            "slot P50", "slot P95", "step-total P50", "step-total max"]
    print(_line(head, args.markdown, header=True))
    for m in methods:
        s = stats[m]
        slot_imb = np.concatenate(s["slot_imb"]) * 100
        step_imb = np.asarray(s["step_imb"]) * 100
        versus = f"{s['work'] / stats['arbor']['work']:.4f}x" if "arbor" in methods else "-"
        print(_line([m, f"{s['work']:,}", versus, f"{s['wall'] / args.steps:.3f}", f"{s['cpu'] / args.steps:.3f}",
                     str(s["slots"]), f"{np.percentile(slot_imb, 50):.4f}", f"{np.percentile(slot_imb, 95):.4f}",
                     f"{np.percentile(step_imb, 50):.4f}", f"{step_imb.max():.4f}"], args.markdown))
    if "arbor" in methods and ref != "arbor":
        a, r = stats["arbor"], stats[ref]
        print(f"\narbor / {ref}: compact work {a['work'] / r['work']:.4f}x, planning time (wall) "
              f"{r['wall'] / a['wall']:.1f}x faster, (cpu) {r['cpu'] / a['cpu']:.1f}x faster")
        print(f"arbor slowest step: {max(row['arbor'][1] for row in rows):.3f} s wall; "
              f"{ref} methods: " + "; ".join(sorted({row[ref][3] for row in rows})))
    return 0


def _line(cells: list[str], markdown: bool, header: bool = False) -> str:
    if not markdown:
        return "  ".join(cells)
    line = "| " + " | ".join(cells) + " |"
    return line + "\n|" + "---|" * len(cells) if header else line


if __name__ == "__main__":
    sys.exit(main())
