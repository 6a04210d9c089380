"""Packing statistics of a TRAJ.jsonl file: trajectories, semantic and compact tokens, compression, segments, depth."""

from __future__ import annotations

import argparse
import json

from planner.jsonl import read_jsonl
from planner.pack import pack


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trajectories", metavar="TRAJ.jsonl", help="trajectories, one JSON object per line")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def stats(path: str) -> dict:
    batch = pack(read_jsonl(path))
    return {
        "trajectories": batch.num_trajectories,
        "semantic_tokens": batch.num_semantic,
        "compact_tokens": batch.num_compact,
        "compression": batch.compression,
        "segments": batch.num_segments,
        "max_depth": batch.max_depth,
    }


def run(args: argparse.Namespace) -> int:
    result = stats(args.trajectories)
    if args.json:
        print(json.dumps(result))
    else:
        width = max(map(len, result))
        for key, value in result.items():
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {shown}")
    return 0
