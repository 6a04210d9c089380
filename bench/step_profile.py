"""Where one microbatch's time goes, flat vs tree, on one GPU: host synchronisations by source line and the CUDA
kernels that take the most time.

    python -m bench.step_profile [--model ling-3-tiny] [--seed 0] [--scale 0.01] [--capacity 65536]
                                 [--attention branch] [--modes flat,tree,duplicate,carry]
                                 [--recompute none|full|selective[:key=value,...]] [--json F]
                                 [--host N] [--reference-rowwise]

Takes the heaviest flat microbatch of `bench.speed`'s baseline and the first Arbor microbatch of the same SWE-like
step, runs each twice (the first run autotunes and compiles), then once with `torch.cuda.set_sync_debug_mode("warn")`
(each synchronising call counted by its last three non-torch stack frames) and once under `torch.profiler`. Last, the
tree's kernel time against an ideal: flat's cost per row for everything but full attention and per causal query-key
pair for flash attention (the tree's pairs shrink less than its rows); the excess is what tree execution adds.

`--modes` picks what runs (default flat,tree): also "duplicate", the whole step in duplicate mode (every microbatch
of the HARTS plan), and "carry", the whole step in carry mode (`bench.speed.carry_step`, every unique row
once), each against the same ideal when flat runs too. "timed run - kernels" is the second unprofiled run's wall time
minus the profiled run's kernel time: the time the GPU waits for the host (preparation, launches,
synchronisations); `bench.idle` says where in the profiled run it lies (before the first kernel, and the longest
gaps between kernels with the host ops at their ends), and `models.tree.regions` what tree execution's own work
(branch view gathers, flash calls and scatter-adds, row gathers, carried context) costs on the device.
`--recompute` picks the activation recomputation of every mode (default full, as bench.speed). `--host N` also runs
each mode once under cProfile and prints its N functions with the most host time (`bench.host_time`).
`--reference-rowwise` picks the row-wise kernels of every mode, as in bench.speed (`bench.kernel_choice`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
import traceback
import warnings

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList

from bench.ceiling import KernelWork, ideal, is_device_work, profiled, tree_regions
from bench.host_time import host_profile
from bench.idle import profile_idle
from bench.kernel_cache import add_kernel_cache_option, open_kernel_cache
from bench.kernel_choice import add_kernel_choice_options, kernel_choice
from bench.kernel_split import describe_split, kernel_split
from bench.speed import (
    carry_step,
    first_fit_flat,
    flat_pairs,
    flat_step,
    heaviest,
    recompute_option,
    sync,
    tree_pairs,
    tree_step,
)
from bench.workloads import swe_like_step
from models.decoder import HybridForCausalLM
from models.presets import preset
from models.recompute import parse_recompute_option
from parallel.plain_runner import PlainRunner
from planner.carry.plan import plan_carry
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack


def sync_sites(fn) -> collections.Counter:
    """Run `fn` once and count its host synchronisations by the three innermost frames outside torch."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/site-packages/torch/" not in f.filename and "warnings" not in f.filename]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:])] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            sync(torch.device("cuda"))
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return sites


def without_annotation_spans(events) -> EventList:
    """Key averages of host events and device work (`bench.ceiling.is_device_work`): without the device-side spans
    of `record_function` regions (`models.tree.regions`), whose "self CUDA" time is the whole region's and would count
    its kernels twice, nor CUPTI's "Command Buffer Full" records."""
    return EventList([e for e in events if e.device_type == DeviceType.CPU or is_device_work(e)])


def overhead_line(flat: KernelWork, tree: KernelWork, name: str) -> str:
    """Mode `name`'s (tree, duplicate or carry) kernel time against its ideal (`bench.ceiling.ideal`): the excess is
    tree overhead, the rest is the work the tree really has (attention pairs shrink less than rows)."""
    best = ideal(flat, tree)
    return (f"{name} kernels {tree.kernel_s:.3f} s; at flat's cost per row (non-attention) and per query-key pair "
            f"(flash) {best.seconds:.3f} s: overhead {tree.kernel_s - best.seconds:+.3f} s (flash "
            f"{tree.flash_s - best.flash_s:+.3f} s, everything else "
            f"{(tree.kernel_s - tree.flash_s) - (best.seconds - best.flash_s):+.3f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ling-3-tiny")
    parser.add_argument("--layers", type=int, default=None,
                        help="only the preset's first N layers (full widths and expert counts)")
    parser.add_argument("--seed", type=int, default=0, help="SWE-like step")
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--attention", default="branch", choices=["dense", "flex", "branch"])
    parser.add_argument("--rows", type=int, default=14, help="kernel table rows")
    parser.add_argument("--modes", default="flat,tree",
                        help="comma-separated: flat (heaviest flat microbatch), tree (first duplicate microbatch), "
                             "duplicate (the whole duplicate step), carry (the whole carry step)")
    parser.add_argument("--recompute", type=recompute_option, default="full", metavar="OPTION",
                        help="activation recomputation of every mode: none, full (default) or "
                             "selective[:key=value,...] as in bench.speed")
    parser.add_argument("--json", help="also write every op's self CUDA time and calls by input shapes, per mode")
    parser.add_argument("--host", type=int, default=0, metavar="ROWS",
                        help="also run each mode once under cProfile and print its ROWS functions with the most host "
                             "time (bench.host_time)")
    add_kernel_cache_option(parser)
    add_kernel_choice_options(parser)
    args = parser.parse_args(argv)
    chosen = args.modes.split(",")
    unknown = sorted(set(chosen) - {"flat", "tree", "duplicate", "carry"})
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose among flat, tree, duplicate, carry")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    kernels = open_kernel_cache(args)
    config = dataclasses.replace(preset(args.model, args.layers), dtype="bfloat16")
    kernels = kernel_choice(args, config.attention_shapes, kernels)
    dev = torch.device("cuda")
    with torch.device(dev):
        model = HybridForCausalLM(config, kernels)
    model.set_activation_checkpointing(parse_recompute_option(args.recompute))
    trajs = swe_like_step(args.seed, scale=args.scale, vocab_size=config.vocab_size, max_path_tokens=args.capacity)
    flat_groups = first_fit_flat(trajs, args.capacity)
    flat = flat_groups[heaviest(flat_groups, trajs)]
    flat_trajs = [trajs[i] for i in flat]
    groups = [[trajs[i] for i in mb.trajectories] for mb in plan_microbatches(trajs, args.capacity, 1).microbatches]
    tree_trajs = groups[0]
    batch = pack(tree_trajs)
    print(f"flat microbatch: {sum(len(t) for t in flat_trajs):,} tokens; tree microbatch: {batch.num_compact:,} "
          f"compact rows, {batch.num_semantic:,} semantic; attention kernels {args.attention_kernels}")
    trie = pack(trajs)
    packed = [pack(g) for g in groups]
    plan = plan_carry(trajs, args.capacity, 1) if "carry" in chosen else None
    runner = PlainRunner(model, attention_backend=args.attention) if plan else None
    steps = {
        "flat": lambda: flat_step(model, flat_trajs, dev, 1e6),
        "tree": lambda: tree_step(model, tree_trajs, dev, 1e6, args.attention),
        "duplicate": lambda: [tree_step(model, g, dev, 1e6, args.attention) for g in groups],
        "carry": lambda: carry_step(model, trajs, plan, dev, 1e6, runner),
    }
    work = {
        "flat": {"rows": sum(len(t) for t in flat_trajs), "pairs": flat_pairs(flat_trajs)},
        "tree": {"rows": batch.num_compact, "pairs": tree_pairs(batch)},
        "duplicate": {"rows": sum(b.num_compact for b in packed), "pairs": sum(tree_pairs(b) for b in packed)},
        "carry": {"rows": trie.num_compact, "pairs": tree_pairs(trie)},
    }
    print(f"duplicate step: {len(groups)} microbatches, {work['duplicate']['rows']:,} rows; carry step: "
          f"{len(plan.microbatches) if plan else '-'} microbatches, {trie.num_compact:,} rows (the trie)")
    modes = {name: steps[name] for name in chosen}
    measured: dict[str, KernelWork] = {}
    dump = {}
    for name, fn in modes.items():
        for run in range(2):
            sync(dev)
            start = time.perf_counter()
            fn()
            sync(dev)
            timed_s = time.perf_counter() - start
            print(f"{name} run {run}: {timed_s:.2f} s", flush=True)
        if args.host:
            print(f"{name}: " + host_profile(fn, args.host, sync=lambda: sync(dev)), flush=True)
        sites = sync_sites(fn)
        print(f"{name}: {sum(sites.values())} host synchronisations")
        for site, count in sites.most_common(10):
            print(f"  {count:5d}  {site}")
        start = time.perf_counter()
        kw, prof = profiled(fn, work[name]["rows"], work[name]["pairs"], record_shapes=bool(args.json))
        wall = time.perf_counter() - start
        measured[name] = kw
        print(f"{name}: wall {wall:.2f} s under the profiler, kernels {kw.kernel_s:.3f} s "
              f"(flash attention {kw.flash_s:.3f} s) for {kw.rows:,} rows, {kw.pairs:.4g} query-key pairs; "
              f"timed run - kernels {timed_s - kw.kernel_s:+.3f} s")
        print(f"{name} under the profiler (whose own host work slows the host): "
              + profile_idle(prof).describe())
        print(f"{name}: " + describe_split(kernel_split(prof, timed_s)))
        regions = tree_regions(prof)
        if regions:
            print(f"{name}: tree execution's own regions (models.tree.regions), device s and calls: "
                  + "; ".join(f"{r} {t:.3f} s / {n}" for r, t, n in regions))
        print(without_annotation_spans(prof.key_averages()).table(
            sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        if args.json:
            ops = [{"name": e.key, "shapes": str(e.input_shapes), "self_cuda_us": e.self_device_time_total,
                    "calls": e.count}
                   for e in without_annotation_spans(prof.key_averages(group_by_input_shape=True))
                   if e.self_device_time_total > 0]
            dump[name] = {"wall_s": wall, "attention_kernels": args.attention_kernels, **dataclasses.asdict(kw),
                          "ops": ops}
        model.zero_grad(set_to_none=True)
    for name in measured:
        if name != "flat" and "flat" in measured:
            print(overhead_line(measured["flat"], measured[name], name))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f)
    print("command: python -m bench.step_profile " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
