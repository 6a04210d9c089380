"""The benchmarks' `--kernel-cache DIR`: the Triton cache of compiled kernels and fla's autotuning results that GPU
runs read and fill (models.ops.kernel_cache, the RL job's `train.kernel_cache`), set with the rest of the kernels'
environment (models.ops.kernel_environment) before any kernel compiles."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.ops.kernel_environment import use_kernel_environment
from models.ops.settings import KernelSettings

__all__ = ["add_kernel_cache_option", "open_kernel_cache"]


def add_kernel_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kernel-cache", metavar="DIR",
        help="GPU runs: Triton's kernel and autotuning cache (wins over TRITON_CACHE_DIR; unset: TRITON_CACHE_DIR, "
             "else ~/.triton/cache); a job's outputs/NAME/kernel-cache shares its compiled kernels",
    )


def open_kernel_cache(args: argparse.Namespace) -> KernelSettings:
    """The kernel settings of `--kernel-cache`, with the kernels' environment set from them (before any kernel
    compiles: `use_kernel_environment`) and the folder named on stderr, so that the first pass's compile time is not
    mistaken for a hang and JSON on stdout stays clean. The benchmark adds its kernel choice to them
    (`bench.kernel_choice.kernel_choice`) and builds its model with the result."""
    kernels = KernelSettings(kernel_cache=None if args.kernel_cache is None else Path(args.kernel_cache))
    try:
        cache = use_kernel_environment(kernels, None, "--kernel-cache")
    except OSError as e:
        sys.exit(f"error: --kernel-cache: cannot create the folder: {e}")
    print(cache.describe(), file=sys.stderr, flush=True)
    return kernels
