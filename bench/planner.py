"""Microbatch planner benchmark: Arbor (planner.microbatch.plan, planner.carry.plan) against the peer baselines
(planner.microbatch.baselines).

    python -m bench.planner [--steps 10] [--dp 4] [--capacity 65536] [--workload swe] [--scale 1.0] [--markdown]
                            [--methods arbor,carry,auto,ortools,...]

For each generated step (bench.workloads, seeds 0..steps-1) every planner plans the same trajectories; we report
compact work (HARTS Table 2; for carry plans the executed rows) against the step's trie rows, planning time (wall
and CPU seconds, one process), scheduled slots, and DP-replica imbalance (HARTS eq. 23, I = max_d w_d / mean_d w_d - 1):
within each slot (P50 and P95 over all slots of all steps) and of the step totals (P50 and max over steps) (HARTS
Table 3). Ratios are baseline / Arbor. Methods: arbor = the HARTS plan (`planner.mode = "duplicate"`), carry and
auto = `planner.step_plan.plan_step` in those modes; for them also the carried context: the longest part context,
the most microbatches open at once, the extra attention-view rows of the cuts, the empty events, and (for
ling-3-tiny's sizes, `context_sizes`) the most bytes one part reads and the most key/value bytes open microbatches
export at once.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import numpy as np

from bench.workloads import swe_like_step, tau2_like_step
from models.config import GatedAttentionConfig, KDAConfig, MLAConfig, ModelConfig
from models.presets import preset
from planner.carry.plan import CarryPlan, ContextSizes, SortedStep
from planner.microbatch.baselines import BASELINES
from planner.microbatch.plan import MicrobatchPlan, imbalance, plan_microbatches
from planner.step_plan import plan_step

__all__ = ["context_sizes", "main"]

#: Methods that return a CarryPlan: the planner mode of each.
CARRY_METHODS = {"carry": "carry", "auto": "auto"}


def context_sizes(config: ModelConfig) -> ContextSizes:
    """Bytes a carried context item takes in `config`'s model (parameter dtype for keys, values and inputs, fp32
    states), each summed over the layers of its kind. Full attention carries projected keys and values; MLA its normed
    latent and shared key (`models.tree.carry_exchange.LATENT_NAMES`)."""
    width = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[config.dtype]
    full = sum(t == "full_attention" for t in config.layer_types)
    linear = len(config.layer_types) - full
    attention, mixer = config.full_attention, config.linear_attention
    if isinstance(attention, MLAConfig):
        kv = attention.kv_lora_rank + attention.qk_rope_head_dim
    elif isinstance(attention, GatedAttentionConfig):
        kv = 2 * attention.num_kv_heads * attention.head_dim
    else:
        kv = 0
    if isinstance(mixer, KDAConfig):
        heads, k, v = mixer.num_heads, mixer.head_dim, mixer.head_dim
        conv = 3 * heads * k
        core = conv + heads * k + heads  # q, k, v, the per-channel gate, beta
    elif mixer is not None:
        heads, k, v = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
        conv = 2 * mixer.num_k_heads * k + heads * v
        core = conv + 2 * heads  # q, k, v, the gate, beta
    else:
        heads = k = v = conv = core = 0
    return ContextSizes(full_attention_row=full * kv * width, linear_state=linear * heads * k * v * 4,
                        linear_row=linear * core * width, conv_row=linear * conv * width,
                        chunk_size=mixer.chunk_size if mixer is not None else 64,
                        conv_width=mixer.conv_size if mixer is not None else 1)


def _run(name: str, trajectories, capacity: int, dp: int, ortools_time_limit: float
         ) -> tuple[MicrobatchPlan | CarryPlan, float]:
    cpu = time.process_time()
    if name == "arbor":
        plan = plan_microbatches(trajectories, capacity, dp)
    elif name in CARRY_METHODS:
        plan = plan_step(trajectories, capacity, dp, CARRY_METHODS[name])
    elif name == "ortools":
        plan = BASELINES[name](trajectories, capacity, dp, time_limit=ortools_time_limit)
    else:
        plan = BASELINES[name](trajectories, capacity, dp)
    return plan, time.process_time() - cpu


def _check(plan: MicrobatchPlan | CarryPlan, n: int, capacity: int, dp: int) -> None:
    if plan.carries:
        if sorted(i for tree in plan.trees for i in tree) != list(range(n)):
            raise AssertionError(f"{plan.method}: trees do not partition the trajectories")
        if any(not mb.parts or mb.compact_tokens > capacity for mb in plan.microbatches):
            raise AssertionError(f"{plan.method}: an empty or over-capacity microbatch")
        return
    covered = sorted(i for mb in plan.microbatches for i in mb.trajectories)
    if covered != list(range(n)):
        raise AssertionError(f"{plan.method}: trajectories not covered exactly once")
    if any(not mb.trajectories or mb.compact_tokens > capacity for mb in plan.microbatches):
        raise AssertionError(f"{plan.method}: an empty or over-capacity microbatch")
    if len(plan.microbatches) % dp:
        raise AssertionError(f"{plan.method}: K is not a multiple of dp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=65_536)
    parser.add_argument("--workload", choices=("swe", "tau2"), default="swe")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the paths of a full step")
    parser.add_argument("--ortools-time-limit", type=float, default=10.0, help="CP-SAT seconds per replica")
    parser.add_argument("--methods", default=",".join(["arbor", *CARRY_METHODS, *BASELINES]),
                        help="comma-separated planners")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    known = ["arbor", *CARRY_METHODS, *BASELINES]
    unknown = [m for m in methods if m not in known]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(known)}")
    make = swe_like_step if args.workload == "swe" else tau2_like_step
    sizes = context_sizes(preset("ling-3-tiny"))
    print("command: python -m bench.planner " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"config: workload={args.workload} steps={args.steps} dp={args.dp} capacity={args.capacity} "
          f"scale={args.scale} ortools_time_limit={args.ortools_time_limit}s/replica methods={','.join(methods)}")

    rows = []
    stats = {m: {"work": 0, "wall": 0.0, "cpu": 0.0, "max_wall": 0.0, "slots": 0, "slot_imb": [], "step_imb": [],
                 "open": 0, "context": 0, "extra_view": 0, "empty": 0, "part_bytes": {}, "held": 0}
             for m in methods}
    trie_total = 0
    for seed in range(args.steps):
        trajectories = make(seed, scale=args.scale)
        raw = sum(len(t) for t in trajectories)
        trie = SortedStep.from_trajectories(trajectories).trie_rows
        trie_total += trie
        row = {"step": seed, "paths": len(trajectories), "raw": raw, "trie": trie}
        for m in methods:
            plan, cpu = _run(m, trajectories, args.capacity, args.dp, args.ortools_time_limit)
            _check(plan, len(trajectories), args.capacity, args.dp)
            w = plan.slot_work()
            s = stats[m]
            s["work"] += plan.total_compact_tokens
            s["wall"] += plan.planning_seconds
            s["max_wall"] = max(s["max_wall"], plan.planning_seconds)
            s["cpu"] += cpu
            s["slots"] += plan.num_slots
            s["slot_imb"].append(imbalance(w))
            s["step_imb"].append(float(imbalance(w.sum(axis=0, keepdims=True))[0]))
            if plan.carries:
                bound = plan.context_bound(sizes)
                s["open"] = max(s["open"], bound.max_open_microbatches)
                s["context"] = max(s["context"], bound.max_context_rows)
                s["extra_view"] += plan.extra_view_rows
                s["empty"] += plan.empty_events
                s["held"] = max(s["held"], bound.held_full_attention_bytes)
                for kind, value in bound.part_bytes.items():
                    s["part_bytes"][kind] = max(s["part_bytes"].get(kind, 0), value)
            row[m] = (plan.total_compact_tokens, plan.planning_seconds, cpu, plan.method)
        rows.append(row)
        print(f"step {seed}: {row['paths']} paths, {raw:,} raw tokens, {trie:,} trie rows; " + "; ".join(
            f"{m} {row[m][0]:,} ({row[m][1]:.2f} s)" for m in methods), flush=True)
        del trajectories

    baselines = [m for m in methods if m in BASELINES]
    ref = "ortools" if "ortools" in baselines else (baselines[-1] if baselines else None)
    compare = "arbor" in methods and ref is not None
    print()
    print(f"Per step (compact work = executed rows; x trie = / the trie's rows; ratio = {ref} / arbor):"
          if compare else "Per step (compact work = executed rows; x trie = / the trie's rows):")
    head = ["step", "paths", "raw tokens", "trie rows"] + [c for m in methods for c in (f"{m} compact", "x trie")]
    if compare:
        head += [f"compact {ref}/arbor", f"time {ref}/arbor"]
    print(_line(head, args.markdown, header=True))
    for row in rows:
        cells = [str(row["step"]), f"{row['paths']:,}", f"{row['raw']:,}", f"{row['trie']:,}"]
        cells += [c for m in methods for c in (f"{row[m][0]:,}", f"{row[m][0] / row['trie']:.4f}")]
        if compare:
            cells += [f"{row[ref][0] / row['arbor'][0]:.4f}x", f"{row[ref][1] / row['arbor'][1]:.1f}x"]
        print(_line(cells, args.markdown))
    print()
    print(f"Summary over all steps ({trie_total:,} trie rows; imbalance: HARTS eq. 23, in %):")
    head = ["method", "compact tokens", "x trie", "vs arbor", "plan wall s (mean)", "plan wall s (max)",
            "plan cpu s (mean)", "slots", "slot P50", "slot P95", "step-total P50", "step-total max"]
    print(_line(head, args.markdown, header=True))
    for m in methods:
        s = stats[m]
        slot_imb = np.concatenate(s["slot_imb"]) * 100
        step_imb = np.asarray(s["step_imb"]) * 100
        versus = f"{s['work'] / stats['arbor']['work']:.4f}x" if "arbor" in methods else "-"
        print(_line([m, f"{s['work']:,}", f"{s['work'] / trie_total:.4f}", versus, f"{s['wall'] / args.steps:.3f}",
                     f"{s['max_wall']:.3f}", f"{s['cpu'] / args.steps:.3f}", str(s["slots"]),
                     f"{np.percentile(slot_imb, 50):.4f}", f"{np.percentile(slot_imb, 95):.4f}",
                     f"{np.percentile(step_imb, 50):.4f}", f"{step_imb.max():.4f}"], args.markdown))
    carried = [m for m in methods if m in CARRY_METHODS]
    if carried:
        print()
        print("Carried context (max over steps; bytes for ling-3-tiny, bf16 keys/values and inputs, fp32 states):")
        head = ["method", "longest context rows", "open microbatches", "extra view rows (sum)", "empty events (sum)",
                "part full-attn GiB", "part linear-attn GiB", "part conv MiB", "held full-attn GiB"]
        print(_line(head, args.markdown, header=True))
        for m in carried:
            s = stats[m]
            b = s["part_bytes"]
            print(_line([m, f"{s['context']:,}", str(s["open"]), f"{s['extra_view']:,}", str(s["empty"]),
                         f"{b['full_attention'] / 2**30:.2f}", f"{b['linear_attention'] / 2**30:.2f}",
                         f"{b['conv'] / 2**20:.1f}", f"{s['held'] / 2**30:.2f}"], args.markdown))
    if compare:
        a, r = stats["arbor"], stats[ref]
        print(f"\narbor / {ref}: compact work {a['work'] / r['work']:.4f}x, planning time (wall) "
              f"{r['wall'] / a['wall']:.1f}x faster, (cpu) {r['cpu'] / a['cpu']:.1f}x faster")
        print(f"arbor slowest step: {max(row['arbor'][1] for row in rows):.3f} s wall; "
              f"{ref} methods: " + "; ".join(sorted({row[ref][3] for row in rows})))
    return 0


def _line(cells: list[str], markdown: bool, header: bool = False) -> str:
    if not markdown:
        return "  ".join(cells)
    line = "| " + " | ".join(cells) + " |"
    return line + "\n|" + "---|" * len(cells) if header else line


if __name__ == "__main__":
    sys.exit(main())
