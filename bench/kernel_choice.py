"""The benchmarks' choice of GPU kernels: `--reference-rowwise` and `--attention-backend` (models.ops.dispatch), used
identically by the flat and tree sides of a run (`bench.speed`, `bench.fidelity`)."""

from __future__ import annotations

import argparse

from models.ops.dispatch import ATTENTION_BACKENDS, set_attention_backend, set_fused_rowwise

__all__ = ["add_kernel_choice_options", "check_kernel_choice", "use_kernel_choice"]


def add_kernel_choice_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference-rowwise", action="store_true",
                        help="run the plain-torch references of the row-wise ops instead of their fused kernels "
                             "(train.fused_rowwise = false; models.ops.dispatch)")
    parser.add_argument("--attention-backend", default="flash", choices=ATTENTION_BACKENDS,
                        help="kernels of full attention, flat and tree alike "
                             "(models.ops.dispatch.set_attention_backend; cudnn: flat backward only)")


def check_kernel_choice(parser: argparse.ArgumentParser, args: argparse.Namespace, branch_backward: bool) -> None:
    """A usage error for a choice the run cannot train: cuDNN attention when the run takes the backward of the tree's
    branch views (`branch_backward`)."""
    if args.attention_backend == "cudnn" and branch_backward:
        parser.error("--attention-backend cudnn trains flat microbatches only (its backward of branch views is "
                     "refused: models/ops/varlen_attention/cudnn.py); use --attention-backend flash, or another "
                     "--attention layout")


def use_kernel_choice(args: argparse.Namespace) -> None:
    """Switch this process to the chosen kernels (GPU runs, before the first forward)."""
    set_fused_rowwise(not args.reference_rowwise)
    set_attention_backend(args.attention_backend)
