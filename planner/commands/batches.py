"""Plan prefix-aware microbatches of a TRAJ.jsonl file: DP replica, slot and compact tokens of each microbatch.

Trajectories are numbered by their line among the file's non-blank lines (0-based). `--json` prints
{"microbatches": [{"trajectories": [...], "replica": int, "slot": int, "compact_tokens": int}, ...],
 "total_compact_tokens": int, "planning_seconds": float}.
"""

from __future__ import annotations

import argparse
import json

from planner.jsonl import read_jsonl
from planner.microbatch import plan_microbatches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trajectories", metavar="TRAJ.jsonl", help="trajectories, one JSON object per line")
    parser.add_argument("--capacity", type=int, required=True, help="unique compact tokens per microbatch (T)")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel replicas (D); K is a multiple of it")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    plan = plan_microbatches(read_jsonl(args.trajectories), args.capacity, args.dp)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    print(f"{len(plan.microbatches)} microbatches on {plan.dp} replicas x {plan.num_slots} slots, "
          f"{plan.total_compact_tokens} compact tokens, planned in {plan.planning_seconds:.3f} s ({plan.method})")
    print(f"{'slot':>5} {'replica':>7} {'compact':>8}  trajectories")
    for mb in plan.microbatches:
        print(f"{mb.slot:>5} {mb.replica:>7} {mb.compact_tokens:>8}  {' '.join(map(str, mb.trajectories))}")
    return 0
