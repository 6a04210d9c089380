"""Plan prefix-aware microbatches of a TRAJ.jsonl file: DP replica, slot and compact tokens of each microbatch.

Trajectories are numbered by their line among the file's non-blank lines (0-based). `--mode` is the planner mode
(planner/step_plan.py): duplicate (default; HARTS, whole trajectories), carry (every unique row once per tree,
parts cut anywhere) or auto (per tree, by the cost model). `--json` prints, for a duplicate plan,
{"microbatches": [{"trajectories": [...], "replica": int, "slot": int, "compact_tokens": int}, ...],
 "total_compact_tokens": int, "planning_seconds": float};
for a carry plan `planner.carry.plan.CarryPlan.to_json()`: microbatches with their parts (tree, start, stop,
context_rows) and the slots they read, the trees' trajectories, every replica's events, `total_compact_tokens`
(executed rows) next to `trie_compact_tokens`, `max_context_rows`, `max_open_microbatches`, `extra_view_rows`,
`empty_events`, `slot_imbalance` (HARTS eq. 23 per slot: p50, p95, max) and `planning_seconds`.
"""

from __future__ import annotations

import argparse
import json

from planner.carry.plan import CarryPlan
from planner.jsonl import read_jsonl
from planner.step_plan import MODES, plan_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trajectories", metavar="TRAJ.jsonl", help="trajectories, one JSON object per line")
    parser.add_argument("--capacity", type=int, required=True, help="unique compact tokens per microbatch (T)")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel replicas (D); K is a multiple of it")
    parser.add_argument("--mode", choices=MODES, default="duplicate", help="planner mode (default duplicate)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _print_carry(plan: CarryPlan) -> None:
    summary = plan.to_json()
    imbalance = summary["slot_imbalance"]
    print(f"{len(plan.microbatches)} microbatches on {plan.dp} replicas x {plan.num_slots} slots, "
          f"{plan.total_compact_tokens} executed rows for {plan.trie_compact_tokens} trie rows "
          f"({plan.total_compact_tokens / plan.trie_compact_tokens:.4f}x), planned in {plan.planning_seconds:.3f} s "
          f"({plan.method})")
    print(f"context: longest {plan.max_context_rows} rows, at most {plan.max_open_microbatches} microbatches open, "
          f"{plan.extra_view_rows} extra view rows, {plan.empty_events} empty events; slot imbalance "
          f"P50 {imbalance['p50']:.2%}, P95 {imbalance['p95']:.2%}, max {imbalance['max']:.2%}")
    print(f"{'slot':>5} {'replica':>7} {'compact':>8} {'reads':>10}  parts (tree:start-stop)")
    for mb in plan.microbatches:
        reads = ",".join(map(str, mb.reads)) or "-"
        parts = " ".join(f"{p.tree}:{p.start}-{p.stop}" for p in mb.parts)
        print(f"{mb.slot:>5} {mb.replica:>7} {mb.compact_tokens:>8} {reads:>10}  {parts}")


def run(args: argparse.Namespace) -> int:
    plan = plan_step(read_jsonl(args.trajectories), args.capacity, args.dp, args.mode)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    if plan.carries:
        _print_carry(plan)
        return 0
    print(f"{len(plan.microbatches)} microbatches on {plan.dp} replicas x {plan.num_slots} slots, "
          f"{plan.total_compact_tokens} compact tokens, planned in {plan.planning_seconds:.3f} s ({plan.method})")
    print(f"{'slot':>5} {'replica':>7} {'compact':>8}  trajectories")
    for mb in plan.microbatches:
        print(f"{mb.slot:>5} {mb.replica:>7} {mb.compact_tokens:>8}  {' '.join(map(str, mb.trajectories))}")
    return 0
