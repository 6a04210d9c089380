"""Minimum-call linear-attention plan (HARTS Algorithm 1): rounds, packed sequences, replay.

INPUT is a TRAJ.jsonl file (segments are those of the packed trie, ids = CompactBatch segment ids) or a segment-tree
JSON {"nodes": [{"id": "R", "parent": null, "tokens": 3}, {"id": "A", "parent": "R", "tokens": 10}, ...]} (one
tree; a parent's tokens precede its children's). The kind is detected from the content. Rounds are numbered from 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from planner.calls.schedule import CallSchedule, min_call_schedule
from planner.calls.segment_tree import SegmentTree, segment_tree_from_json
from planner.jsonl import read_jsonl
from planner.pack import pack


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="INPUT", help="TRAJ.jsonl or a segment-tree JSON")
    parser.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk size B (default 64)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def load_tree(path: str) -> tuple[SegmentTree, str]:
    """The segment tree of INPUT and a one-line description of what was read."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        obj = json.loads(file.read_text())
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and "nodes" in obj:
        try:
            tree = segment_tree_from_json(obj)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return tree, f"segment-tree JSON, {tree.num_segments} segments"
    batch = pack(read_jsonl(path))
    return SegmentTree.from_batch(batch), (
        f"TRAJ.jsonl, {batch.num_trajectories} trajectories, {batch.num_compact} compact rows, "
        f"{batch.num_segments} segments"
    )


def to_json(schedule: CallSchedule) -> dict:
    tree = schedule.tree
    name = (lambda g: tree.names[g]) if tree.names is not None else int
    bounds = np.searchsorted(schedule.seq_round, np.arange(schedule.num_rounds + 1))
    rounds = []
    for r in range(schedule.num_rounds):
        sequences = [
            {
                "segments": [name(int(g)) for g in schedule.segments_of(n)],
                "replay": int(schedule.seq_replay[n]),
                "anchor": int(schedule.seq_anchor[n]),
            }
            for n in range(bounds[r], bounds[r + 1])
        ]
        rounds.append({"round": r + 1, "replay": int(schedule.round_replay[r]), "sequences": sequences})
    return {"num_rounds": schedule.num_rounds, "total_replay": schedule.total_replay, "rounds": rounds}


def run(args: argparse.Namespace) -> int:
    tree, described = load_tree(args.input)
    schedule = min_call_schedule(tree, args.chunk_size)
    result = to_json(schedule)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"input        {args.input} ({described})")
    print(f"chunk size   {schedule.chunk_size}")
    print(f"rounds       {result['num_rounds']}")
    print(f"replay R     {result['total_replay']}")
    for rnd in result["rounds"]:
        print(f"round {rnd['round']}: {len(rnd['sequences'])} sequences, replay {rnd['replay']}")
        for seq in rnd["sequences"]:
            chain = " -> ".join(map(str, seq["segments"]))
            print(f"  anchor {seq['anchor']:>8}  replay {seq['replay']:>4}  {chain}")
    return 0
