"""The benchmarks' choice of GPU kernels: `--reference-rowwise` and `--attention-kernels`, as the
`models.ops.settings.KernelSettings` of the model a benchmark builds, so the flat and tree sides of a run use them
identically (`bench.speed`, `bench.fidelity`, `bench.step_profile`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from models.ops.settings import KernelSettings
from models.ops.varlen_attention import ATTENTION_CHOICES, auto_cuda_attention, check_cuda_attention

__all__ = ["add_kernel_choice_options", "check_attention_pair", "kernel_choice"]


def add_kernel_choice_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference-rowwise", action="store_true",
                        help="run the plain-torch references of the row-wise ops instead of their fused kernels "
                             "(train.fused_rowwise = false; KernelSettings.fused_rowwise)")
    parser.add_argument("--attention-kernels", choices=list(ATTENTION_CHOICES), default="auto",
                        help="CUDA attention kernel pair of both modes: flash (torch's FlashAttention-2), fa4 "
                             "(FlashAttention-4, the optional flash-attn-4 package, Hopper or newer) or auto (fa4 "
                             "where it can run, else flash; the default)")


def kernel_choice(args: argparse.Namespace, shapes=(), kernels: KernelSettings = KernelSettings()) -> KernelSettings:
    """`kernels` (GPU runs: what `bench.kernel_cache.open_kernel_cache` returned) with the flags' row-wise ops and
    attention pair, for a model whose attention layers have `shapes` (`ModelConfig.attention_shapes`: what "auto"
    decides by); exits with the reason when the chosen attention kernels cannot run here. `args.attention_kernels`
    becomes the pair that runs ("auto" resolved, its reason printed on stderr), so what a benchmark prints and records
    names the kernels."""
    if args.attention_kernels == "auto":
        args.attention_kernels, why = auto_cuda_attention(shapes)
        print(f"attention kernels {args.attention_kernels} (--attention-kernels auto: {why})", file=sys.stderr)
    check_attention_pair(args.attention_kernels)
    return dataclasses.replace(kernels, fused_rowwise=not args.reference_rowwise, attention=args.attention_kernels)


def check_attention_pair(pair: str, option: str = "--attention-kernels") -> None:
    """`check_cuda_attention(pair)`, or exit naming `option` and the reason when the pair cannot run here."""
    try:
        check_cuda_attention(pair)
    except RuntimeError as e:
        raise SystemExit(f"error: {option} {pair}: {e}") from None
