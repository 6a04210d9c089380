"""The benchmarks' choice of GPU kernels: `--reference-rowwise` (models.ops.dispatch), used identically by the flat
and tree sides of a run (`bench.speed`, `bench.fidelity`, `bench.step_profile`)."""

from __future__ import annotations

import argparse

from models.ops.dispatch import set_fused_rowwise

__all__ = ["add_kernel_choice_options", "use_kernel_choice"]


def add_kernel_choice_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference-rowwise", action="store_true",
                        help="run the plain-torch references of the row-wise ops instead of their fused kernels "
                             "(train.fused_rowwise = false; models.ops.dispatch)")


def use_kernel_choice(args: argparse.Namespace) -> None:
    """Switch this process to the chosen kernels (GPU runs, before the first forward)."""
    set_fused_rowwise(not args.reference_rowwise)
