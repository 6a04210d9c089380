"""The benchmarks' `--kernel-cache DIR`: the Triton cache of compiled kernels and fla's autotuning results that GPU
runs read and fill (models.ops.kernel_cache, the RL job's `train.kernel_cache`)."""

from __future__ import annotations

import argparse
import sys

from models.ops.kernel_cache import use_kernel_cache

__all__ = ["add_kernel_cache_option", "open_kernel_cache"]


def add_kernel_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kernel-cache", metavar="DIR",
        help="GPU runs: Triton's kernel and autotuning cache (wins over TRITON_CACHE_DIR; unset: TRITON_CACHE_DIR, "
             "else ~/.triton/cache); a job's outputs/NAME/kernel-cache shares its compiled kernels",
    )


def open_kernel_cache(args: argparse.Namespace) -> None:
    """Point Triton at `--kernel-cache` (before any kernel compiles) and name the folder on stderr, so that the
    first pass's compile time is not mistaken for a hang and JSON on stdout stays clean."""
    try:
        cache = use_kernel_cache(args.kernel_cache, None, "--kernel-cache")
    except OSError as e:
        sys.exit(f"error: --kernel-cache: cannot create the folder: {e}")
    print(cache.describe(), file=sys.stderr, flush=True)
