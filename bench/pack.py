"""Packing speed: trajectories -> compact trie layout (planner.pack) on SWE-like steps.

    python -m bench.pack [--seeds 0 1 2] [--scale 1.0] [--repeat 3]

For each generated step (bench.workloads.swe_like_step: ~2,000 paths, 35-59M raw tokens) it prints the number of
trajectories, raw (semantic) and compact tokens, compression, and the median packing time over `--repeat` runs on one
process, plus tokens per second. Generation time is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.workloads import swe_like_step
from planner.pack import pack


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of a full step's paths")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'seed':>4} {'paths':>6} {'raw tokens':>12} {'compact':>11} {'compr.':>7} {'pack s':>7} {'Mtok/s':>7}")
    for seed in args.seeds:
        trajectories = swe_like_step(seed, scale=args.scale)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            batch = pack(trajectories)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        S = batch.num_semantic
        print(f"{seed:>4} {len(trajectories):>6} {S:>12,} {batch.num_compact:>11,} {batch.compression:>7.2f} "
              f"{t:>7.2f} {S / t / 1e6:>7.1f}")
        del batch, trajectories
    print("command: python -m bench.pack " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
