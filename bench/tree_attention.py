"""Tree full attention on one GPU: HARTS's branch views (gathered ancestor KV, varlen flash) against compiled
FlexAttention with the O(C) ancestor mask and block sparsity, on the microbatches of a SWE-like step.

    python -m bench.tree_attention [--scale 0.01] [--capacity 65536] [--heads 16] [--qk-dim 192] [--v-dim 128]

Per microbatch: the rows C, the branch-view key rows A (what the branch backend reads), the block-mask build time
(once per microbatch, shared by all layers), forward+backward time of one attention layer per backend (median of
`--iters` after a warm-up that compiles), their ratio, and the relative error of flex against branch. Shapes default
to ling-3-tiny's MLA (16 heads, q/k 192 = 128 nope + 64 rope, v 128).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.workloads import swe_like_step
from models.tree.attention import tree_attention
from models.tree.layout import build_attention_layout
from planner.calls.plan import plan_calls
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack


def fwd_bwd_seconds(fn, inputs, iters: int) -> float:
    times = []
    for i in range(iters + 1):
        for t in inputs:
            t.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*inputs).float().square().mean().backward()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tree_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--qk-dim", type=int, default=192)
    parser.add_argument("--v-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--max-microbatches", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    dev = torch.device("cuda")
    trajs = swe_like_step(0, scale=args.scale, vocab_size=1000, max_path_tokens=args.capacity)
    plan = plan_microbatches(trajs, args.capacity, 1)
    print(f"{'C':>8} {'views A':>9} {'mask s':>7} {'branch ms':>10} {'flex ms':>8} {'flex/branch':>11} {'rel err':>8}")
    for mb in plan.microbatches[: args.max_microbatches]:
        batch = pack([trajs[i] for i in mb.trajectories])
        calls = plan_calls(batch, 64)
        layout = build_attention_layout(batch, calls.physical_to_compact, calls.compact_to_physical,
                                        calls.seq_row_offsets, dev)
        C, H = batch.num_compact, args.heads
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k = (torch.randn(C, H, args.qk_dim, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(C, H, args.v_dim, device=dev, generator=gen, dtype=torch.bfloat16)
        inputs = [t.requires_grad_() for t in (q, k, v)]
        scale = args.qk_dim**-0.5
        torch.cuda.synchronize()
        start = time.perf_counter()
        layout.block_mask()
        torch.cuda.synchronize()
        mask_s = time.perf_counter() - start
        timing = {
            backend: fwd_bwd_seconds(lambda q, k, v, b=backend: tree_attention(q, k, v, layout, scale, b), inputs,
                                     args.iters)
            for backend in ("branch", "flex")
        }
        with torch.no_grad():
            a = tree_attention(q, k, v, layout, scale, "branch").float()
            b = tree_attention(q, k, v, layout, scale, "flex").float()
        err = ((a - b).norm() / a.norm()).item()
        print(f"{C:>8,} {layout.kv_index.numel():>9,} {mask_s:>7.2f} {timing['branch'] * 1e3:>10.1f} "
              f"{timing['flex'] * 1e3:>8.1f} {timing['flex'] / timing['branch']:>11.2f} {err:>8.1e}")
    print("command: python -m bench.tree_attention " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
