"""Planning time of the minimum-call linear-attention planner (HARTS Algorithm 1) against segment count.

    python -m bench.calls [--sizes 1000 3000 10000 30000 100000] [--shape random|deep] [--chunk-size 64]

Random segment trees: `random` attaches each segment to a uniformly chosen earlier one (shallow, bushy); `deep`
attaches it to one of the 3 previous segments (depth ~ G/2, long chains of forks). Segment lengths are uniform in
[1, max_tokens]. Times are the best of --repeat runs: tree construction and validation, Algorithm 1 (both passes and
the schedule), and the physical layout (ExecutionPlan). Linear scaling shows as a flat us/segment column.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from planner.calls.plan import build_execution_plan
from planner.calls.schedule import min_call_schedule
from planner.calls.segment_tree import SegmentTree


def random_tree(num_segments: int, shape: str, max_tokens: int, rng: np.random.Generator):
    """parent [G] and lengths [G] of a random segment tree."""
    i = np.arange(1, num_segments)
    if shape == "random":
        parent = (rng.random(num_segments - 1) * i).astype(np.int64)
    else:
        parent = i - 1 - rng.integers(0, np.minimum(i, 3))
    return np.concatenate([[-1], parent]), rng.integers(1, max_tokens + 1, size=num_segments)


def best_of(repeat: int, fn):
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calls", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 10000, 30000, 100000])
    parser.add_argument("--shape", choices=["random", "deep"], default="random")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="segment lengths uniform in [1, max_tokens]")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("command: python -m bench.calls " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"config:  {vars(args)}")
    columns = [("segments", 9), ("rows C", 10), ("depth", 7), ("rounds", 6), ("replay R", 9), ("tree s", 8),
               ("alg1 s", 8), ("layout s", 9), ("us/seg", 7)]
    print(" ".join(f"{name:>{width}}" for name, width in columns))
    rng = np.random.default_rng(args.seed)
    for G in args.sizes:
        parent, lengths = random_tree(G, args.shape, args.max_tokens, rng)
        t_tree, tree = best_of(args.repeat, lambda: SegmentTree.from_lengths(parent, lengths))
        t_alg, schedule = best_of(args.repeat, lambda: min_call_schedule(tree, args.chunk_size))
        t_layout, plan = best_of(args.repeat, lambda: build_execution_plan(schedule))
        total = t_tree + t_alg + t_layout
        print(
            f"{G:>9} {int(lengths.sum()):>10} {int(tree.depth.max()):>7} {plan.num_rounds:>6} {plan.total_replay:>9} "
            f"{t_tree:>8.3f} {t_alg:>8.3f} {t_layout:>9.3f} {1e6 * total / G:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
