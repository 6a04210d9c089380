"""Tree vs trajectory-wise training speed on one device (HARTS §5.3, Table 4), with and without prefix carry.

    python -m bench.speed --model ling-3-tiny --dtype bfloat16 --device cuda --scale 0.05 --capacity 65536

One process, one model (random init), full-layer activation recomputation unless `--recompute` names other options
(none, full, selective ones; several run one after the other: a table each, then seconds and peak GiB of every
option and mode side by side; `--compare-rowwise` runs each option with the reference row-wise ops and then with
the fused kernels, `--compare-attention` with flash's and then FlashAttention-4's attention kernels, and prints each
mode's time ratio), the same kernels in every mode
(`--modes`, default all three, timed one after the other in one run):
- flat (the baseline): trajectories packed by raw tokens into microbatches of at most `capacity` tokens (first fit
  in input order, no sharing), flat packed varlen forward, log-probs, loss, backward;
- duplicate (Arbor's HARTS plan; "tree" in the table and the JSON): the prefix-aware microbatch plan (capacity =
  compact tokens; a tree larger than a microbatch executes its shared prefix in each of its microbatches), then per
  microbatch `models.microbatch.prepare_microbatch` (pack -> minimum-call plan -> TreeLayout, as every trainer rank
  does) -> tree forward -> mapped log-probs -> the same loss -> backward;
- carry: `planner.carry.plan.plan_carry` (parts of at most `capacity` rows, every unique row once), then
  `parallel.replica.prepare_step` and `parallel.plain_runner.PlainRunner.train_step` with the same loss
  (policy term over the trained positions and the same balance term of each microbatch's MoE statistics). Its
  events interleave microbatches, so a carry pass is timed as a whole (its fastest pass counts).
F/B/Grad time = everything after the microbatch plan except the optimizer (incl. the per-microbatch preparation);
Core adds Arbor's microbatch planner. Every mode accumulates gradients over all its microbatches; peak memory
(cuda) is each mode's own. Workloads: SWE-like trees (bench.workloads) and a low-sharing workload (compression
~1.2). The `auto` mode (when flat and duplicate run) runs the duplicate plan as the RL job's `planner.mode = "auto"`
does, under a linear cost model fitted to this run's own measurements: each microbatch as its trie, or as its flat
expansion when the model predicts that faster and the expansion fits the capacity (`CostModel.runs_flat`, the
planner's choice: `planner.microbatch.flat`, charged to Core like the plan). MFU (cuda) is printed for each mode in
two forms (`bench.flops`): 6 per active parameter and executed row, and with full attention's products over the
causal query-key pairs executed. (Earlier versions packed the other microbatches' trajectories flat like the
baseline instead: the "auto x" columns of docs/history.md's earlier sections measured that.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
import torch

from bench.ceiling import KernelWork, ideal, profiled
from bench.flops import PEAK_FLOPS, active_params, attention_flops_per_pair, mfu
from bench.kernel_cache import add_kernel_cache_option, open_kernel_cache
from bench.kernel_choice import add_kernel_choice_options, check_attention_pair, kernel_choice
from bench.workloads import swe_like_step
from models.decoder import HybridForCausalLM
from models.logprobs import compact_logprobs
from models.microbatch import Microbatch, prepare_microbatch
from models.moe import load_balancing_loss
from models.ops.settings import KernelSettings
from models.ops.varlen_attention import CUDA_ATTENTION
from models.presets import preset
from models.recompute import parse_recompute_option
from models.tree.mixers import TreeContext
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.carry.plan import plan_carry
from planner.cost_model import CostModel
from planner.microbatch.flat import with_flat_choices
from planner.microbatch.plan import plan_microbatches
from planner.pack import pack
from planner.trajectory import Trajectory

#: What `--modes` may name, in the order they run; "duplicate" is reported under "tree".
MODES = ("flat", "duplicate", "carry")
#: Each mode's key in a result row.
MODE_KEYS = ("flat", "tree", "carry", "auto")


def low_sharing_step(seed: int, paths: int, length: int, vocab: int) -> list[Trajectory]:
    """Pairs of trajectories that share a prompt of 1/3 of their length: compression 2L / (2L - L/3) = 1.2."""
    rng = np.random.default_rng([seed, 0x10])
    out = []
    for i in range(0, paths, 2):
        prompt = rng.integers(0, vocab, size=length // 3)
        for _ in range(2):
            tail = rng.integers(0, vocab, size=length - prompt.size)
            out.append(Trajectory(np.concatenate([prompt, tail]), tree=f"low{i}"))
    return out


def first_fit_flat(trajectories, capacity: int) -> list[list[int]]:
    batches, sizes = [], []
    for i, t in enumerate(trajectories):
        for b, size in enumerate(sizes):
            if size + len(t) <= capacity:
                batches[b].append(i)
                sizes[b] += len(t)
                break
        else:
            batches.append([i])
            sizes.append(len(t))
    return batches


def heaviest(groups: list[list[int]], trajectories) -> int:
    """Index of the group (of trajectory indices) holding the most tokens: the baseline's fullest flat microbatch."""
    return max(range(len(groups)), key=lambda k: sum(len(trajectories[i]) for i in groups[k]))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def loss_of(logprobs, mask, adv, stats, normalizer):
    policy = -(adv * mask * logprobs).sum() / normalizer
    moe = [s for s in stats if s is not None]
    aux = sum(load_balancing_loss(s) for s in moe) if moe else 0.0
    return policy + 1e-3 * aux


def flat_step(model, trajectories, device, normalizer) -> None:
    ids = torch.as_tensor(np.concatenate([t.tokens for t in trajectories]), device=device)
    lengths = [len(t) for t in trajectories]
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device)
    pos = torch.as_tensor(np.concatenate([np.arange(n) for n in lengths]), device=device)
    out = model.hidden_states(ids, pos, cu)
    rows = torch.arange(ids.numel(), device=device) - 1
    rows[cu[:-1]] = -1
    lp = compact_logprobs(out.hidden, model.lm_head_weight, rows, ids, fused=model.kernels.fused_rowwise)
    mask = (rows >= 0).to(lp.dtype)
    adv = torch.as_tensor(np.concatenate([t.advantage for t in trajectories]), device=device, dtype=lp.dtype)
    loss_of(lp, mask, adv, out.moe_stats, normalizer).backward()


def tree_step(model, trajectories, device, normalizer, backend, flat: bool = False) -> Microbatch:
    """One microbatch's forward, loss and backward: its trie, or with `flat` its flat expansion."""
    mb = prepare_microbatch(trajectories, model.config, device, flat=flat)
    layout = mb.layout
    out = model.tree_hidden_states(TreeContext(layout, backend))
    lp = compact_logprobs(out.hidden, model.lm_head_weight, layout.logit_row, layout.target,
                          fused=model.kernels.fused_rowwise)
    mask = (layout.logit_row >= 0).to(lp.dtype)
    adv = torch.as_tensor(mb.batches[0].advantage, device=device, dtype=lp.dtype)
    loss_of(lp, mask, adv, out.moe_stats, normalizer).backward()
    return mb


def carry_step(model, trajectories, plan, device, normalizer, runner: PlainRunner):
    """One carry pass: this (only) replica's carry microbatches prepared, then run in the plan's event order with
    `loss_of`'s loss (advantages and trained positions from each microbatch's loss inputs)."""
    step = prepare_step(trajectories, plan, dp_rank=0, dp_group=None, model_config=model.config,
                                 aggregation="token-mean", device=device)

    def loss_fn(logprobs, mb, output):
        adv, trained = (x.to(logprobs.dtype) for x in (mb.loss.advantage, mb.loss.trained))
        return loss_of(logprobs, trained, adv, output.moe_stats, normalizer), {}

    runner.train_step(step, loss_fn)
    return step


def view_rows(mb: Microbatch) -> int:
    """Rows of the gathered ancestor views of the microbatch's full attention."""
    return int(mb.layout.attention.kv_index.numel())


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def flat_pairs(trajectories) -> float:
    """Causal full-attention work of trajectory-wise execution: query-key pairs, every token of every trajectory."""
    return sum(len(t) * (len(t) + 1) / 2 for t in trajectories)


def tree_pairs(batch) -> float:
    """Causal full-attention work of a packed microbatch: each compact row against its ancestors and itself."""
    return float((batch.positions.astype(np.float64) + 1).sum())


def run_workload(name, trajectories, model, args, device) -> tuple[dict, dict]:
    rng = np.random.default_rng(args.seed)
    for t in trajectories:
        t.advantage = rng.normal(size=len(t))
    S = sum(len(t) for t in trajectories)
    normalizer = float(S)
    modes = args.modes

    # The microbatch plans (charged to Core only).
    plan_seconds = carry_plan_seconds = None
    if "duplicate" in modes:
        start = time.perf_counter()
        mplan = plan_microbatches(trajectories, args.capacity, 1)
        plan_seconds = time.perf_counter() - start
        groups = [list(mb.trajectories) for mb in mplan.microbatches]
    if "carry" in modes:
        start = time.perf_counter()
        cplan = plan_carry(trajectories, args.capacity, 1)
        carry_plan_seconds = time.perf_counter() - start
        runner = PlainRunner(model, attention_backend=args.attention, resident=args.carry_resident)
    flat_groups = first_fit_flat(trajectories, args.capacity)

    def run_flat(group):
        flat_step(model, [trajectories[i] for i in group], device, normalizer)

    results = {}
    per_mb = {}
    for mode in modes:
        # Every microbatch shape is run once untimed first: Triton autotunes per shape, and a first pass would
        # charge that to whichever mode has more distinct microbatches (a shape's first pass takes several times a later
        # one). Then `repeat` timed passes; each microbatch counts with its fastest pass (run-to-run noise: the top of
        # bench/RESULTS.md); a carry pass counts as one unit (its events interleave microbatches).
        passes = []
        for timed_pass in range(args.warmup + args.repeat):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, mbs = [], []
            if mode == "flat":
                for g in flat_groups:
                    dt, _ = timed(lambda: run_flat(g), device)
                    times.append(dt)
            elif mode == "duplicate":
                for g in groups:
                    sub = [trajectories[i] for i in g]
                    dt, mb = timed(lambda: tree_step(model, sub, device, normalizer, args.attention), device)
                    times.append(dt)
                    mbs.append(mb)
            else:
                dt, step = timed(lambda: carry_step(model, trajectories, cplan, device, normalizer, runner), device)
                times.append(dt)
                mbs = list(step)
            if timed_pass >= args.warmup:
                passes.append(times)
        times = [min(ts) for ts in zip(*passes)]
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        per_mb[mode] = (times, mbs)
        key = "tree" if mode == "duplicate" else mode
        count = len(mbs) if mode == "carry" else len(times)
        results[key] = {"seconds": sum(times), "microbatches": count, "peak_gib": peak}
        calls = (f", linear-attention calls per layer {sum(mb.linear_attention_calls for mb in mbs)} in "
                 f"{sum(mb.layout.linear_calls.rounds for mb in mbs)} rounds" if mbs else "")
        print(f"{name} {mode}: {count} microbatches, {sum(times):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times)}), peak {peak:.1f} GiB{calls}", file=sys.stderr, flush=True)
    model.zero_grad(set_to_none=True)

    flat_s = results["flat"]["seconds"] if "flat" in results else None
    row = {"workload": name, "trajectories": len(trajectories), "semantic_tokens": S}
    params, per_pair = active_params(model), attention_flops_per_pair(model.config)
    peak_flops = PEAK_FLOPS.get(device.type)

    def utilisation(rows: float, pairs: float, seconds: float) -> dict:
        """MFU of `rows` rows and `pairs` query-key pairs in `seconds`: 6 N only (the common form), and with
        full attention's products (bench.flops)."""
        if not peak_flops:
            return {}
        return {"mfu": mfu(params, rows, 0, pairs, seconds, peak_flops),
                "mfu_attention": mfu(params, rows, per_pair, pairs, seconds, peak_flops)}
    state = {"trajectories": trajectories, "normalizer": normalizer}
    if "duplicate" in modes:
        mbs = per_mb["duplicate"][1]
        batches = [mb.batches[0] for mb in mbs]
        C = sum(b.num_compact for b in batches)
        tree_s = results["tree"]["seconds"]
        pairs = sum(tree_pairs(b) for b in batches)
        fbg = flat_s / tree_s if flat_s is not None else None
        row.update({
            "compact_tokens": C,
            "compression": S / C,
            "attention_compression": flat_pairs(trajectories) / pairs,
            "replay_tokens": int(sum(mb.call_plan.total_replay for mb in mbs)),
            "rounds_max": int(max(mb.call_plan.num_rounds for mb in mbs)),
            "attention_view_rows": sum(view_rows(mb) for mb in mbs),
            "planning_seconds": plan_seconds,
        })
        state.update({"plan": mplan, "groups": groups,
                      "tree_samples": [(mb.num_compact, view_rows(mb), t)
                                       for mb, t in zip(mbs, per_mb["duplicate"][0])]})
    if "flat" in modes:
        row["flat"] = {**results["flat"], **utilisation(S, flat_pairs(trajectories), flat_s)}
        row["flat_tokens_per_s"] = S / flat_s
    if {"flat", "duplicate"} <= set(modes) and not args.no_auto:
        row["expansion"] = time_expansion(model, trajectories, flat_groups, per_mb["flat"][0], normalizer, args,
                                          device)
        state["expansion_samples"] = [(row["expansion"]["tokens"], row["expansion"]["seconds"])]
    if "duplicate" in modes:
        row.update({
            "tree": results["tree"],
            "fbg_speedup": fbg,
            "fbg_over_compression": fbg / (S / C) if fbg is not None else None,
            "core_speedup": flat_s / (tree_s + plan_seconds) if flat_s is not None else None,
            "tree_semantic_tokens_per_s": S / tree_s,
        })
        row["tree"].update(utilisation(C, pairs, tree_s))
    if "carry" in modes:
        executed = sum(mb.num_compact for mb in per_mb["carry"][1])
        carry_s = results["carry"]["seconds"]
        row["carry"] = {**results["carry"], "executed_rows": executed, "trie_rows": cplan.trie_compact_tokens,
                        "executed_over_trie": executed / cplan.trie_compact_tokens,
                        "planning_seconds": carry_plan_seconds, "semantic_tokens_per_s": S / carry_s,
                        **utilisation(executed, sum(tree_pairs(pack([trajectories[i] for i in tree]))
                                                    for tree in cplan.trees), carry_s)}
        row["carry_speedup"] = flat_s / carry_s if flat_s is not None else None
        carried = per_mb["carry"][1]
        state["carry_samples"] = [(executed, sum(view_rows(mb) for mb in carried),
                                   sum(mb.layout.attention.context_rows for mb in carried), carry_s)]
    if args.ceiling and device.type == "cuda" and flat_s is not None and ({"duplicate", "carry"} & set(modes)):
        flat_t = [trajectories[i] for i in flat_groups[heaviest(flat_groups, trajectories)]]
        flat_w, _ = profiled(lambda: flat_step(model, flat_t, device, normalizer), sum(len(t) for t in flat_t),
                             flat_pairs(flat_t))
        if "duplicate" in modes:
            group, batch = max(((g, mb.batches[0]) for g, mb in zip(groups, per_mb["duplicate"][1])),
                               key=lambda gb: gb[1].num_compact)
            tree_t = [trajectories[i] for i in group]
            tree_w, _ = profiled(lambda: tree_step(model, tree_t, device, normalizer, args.attention),
                                 batch.num_compact, tree_pairs(batch))
            row["ceiling"] = ceiling_of(flat_w, tree_w, fbg)
        if "carry" in modes:
            trie = pack(trajectories)
            carry_w, _ = profiled(lambda: carry_step(model, trajectories, cplan, device, normalizer, runner),
                                  trie.num_compact, tree_pairs(trie))
            row["carry_ceiling"] = ceiling_of(flat_w, carry_w, row["carry_speedup"])
        model.zero_grad(set_to_none=True)
    return row, state


def ceiling_line(workload: str, e: dict, what: str = "tree") -> str:
    """The console line of `ceiling_of`'s result for the heaviest tree microbatch (`what` "tree") or the whole carry
    step ("carry")."""
    measured = "heaviest flat and tree microbatch" if what == "tree" else "heaviest flat microbatch, whole carry step"
    return (f"{workload}: exact-execution ceiling (bench.ceiling, {measured}): {what} kernels "
            f"{e['tree_kernel_s']:.3f} s against {e['ideal_s']:.3f} s at flat's costs: the {what} runs at "
            f"{e['share']:.2f} of its ceiling, whose F/B/Grad speedup is {e['ceiling_speedup']:.2f}x")


def ceiling_of(flat_w: KernelWork, tree_w: KernelWork, speedup: float) -> dict:
    """How close `tree_w` (a tree microbatch, or a whole carry step) runs to its exact-execution ceiling at the flat
    microbatch `flat_w`'s costs (`bench.ceiling`: ideal / measured kernel time), and the F/B/Grad speedup it would
    reach there (the measured `speedup` over that share)."""
    best = ideal(flat_w, tree_w)
    share = best.share_of(tree_w)
    return {"tree_kernel_s": tree_w.kernel_s, "ideal_s": best.seconds, "share": share,
            "ceiling_speedup": speedup / share}


def time_expansion(model, trajectories, flat_groups, flat_times, normalizer, args, device) -> dict:
    """The heaviest flat microbatch run as a flat expansion through the tree path (`tree_step(flat=True)`: what
    auto mode runs instead of a trie that shares too little), against its own trajectory-wise time `flat_times`;
    untimed passes first, then the fastest timed pass."""
    k = heaviest(flat_groups, trajectories)
    sub = [trajectories[j] for j in flat_groups[k]]
    times = []
    for timed_pass in range(args.warmup + args.repeat):
        model.zero_grad(set_to_none=True)
        dt, _ = timed(lambda: tree_step(model, sub, device, normalizer, args.attention, flat=True), device)
        if timed_pass >= args.warmup:
            times.append(dt)
    model.zero_grad(set_to_none=True)
    return {"tokens": sum(len(t) for t in sub), "seconds": min(times), "flat_seconds": flat_times[k]}


def fit_cost_model(states: list[dict]) -> dict:
    """`planner.cost_model.CostModel`'s coefficients fitted on every workload's measurements: seconds per tree
    compact row and attention-view row over the HARTS microbatches (least squares through the origin; a negative
    coefficient is dropped and the other refitted), per token of a flat expansion (`time_expansion`), and with
    carry steps that carried context, per context row (`carry_context_cost`)."""
    tree = np.array([x for st in states for x in st["tree_samples"]], dtype=float)
    coef, *_ = np.linalg.lstsq(tree[:, :2], tree[:, 2], rcond=None)
    if coef.min() < 0:
        keep = int(np.argmax(coef))
        coef = np.zeros(2)
        coef[keep] = tree[:, 2] @ tree[:, keep] / (tree[:, keep] @ tree[:, keep])
    expansion = np.array([x for st in states for x in st["expansion_samples"]], dtype=float)
    fit = {"tree_per_compact": float(coef[0]), "tree_per_view_row": float(coef[1]),
           "expansion_per_token": float(expansion[:, 1].sum() / expansion[:, 0].sum())}
    carry = [x for st in states for x in st.get("carry_samples", ())]
    per_context = carry_context_cost(carry, fit["tree_per_compact"], fit["tree_per_view_row"])
    if per_context is not None:
        fit["carry_per_context_row"] = per_context
    return fit


def carry_context_cost(samples, per_compact: float, per_view_row: float) -> float | None:
    """Seconds per carried context row: what carry steps (`samples` of (own rows, view rows, context rows,
    seconds)) took beyond their rows and views at the tree's costs, over their context rows (0 when not more);
    None when they carried no context (nothing to fit)."""
    context = sum(p for _, _, p, _ in samples)
    if not context:
        return None
    beyond = sum(t - per_compact * c - per_view_row * v for c, v, _, t in samples)
    return max(beyond, 0.0) / context


def run_auto(state: dict, cost: dict, model, args, device) -> dict:
    """The HARTS plan's microbatches as the RL job's auto mode runs a HARTS plan under `cost`: each as its trie or,
    where the planner marks it (`CostModel.runs_flat`, untimed like the plan), as its flat expansion (its
    preparation timed as for the other modes); an untimed pass first (new shapes), then each microbatch's fastest
    pass."""
    trajectories, normalizer = state["trajectories"], state["normalizer"]
    planned = with_flat_choices(state["plan"], trajectories, CostModel(**cost)).microbatches
    flat = sum(mb.flat for mb in planned)
    passes = []
    for timed_pass in range(args.warmup + args.repeat):
        model.zero_grad(set_to_none=True)
        times = []
        for mb in planned:
            sub = [trajectories[i] for i in mb.trajectories]
            dt, _ = timed(lambda: tree_step(model, sub, device, normalizer, args.attention, mb.flat), device)
            times.append(dt)
        if timed_pass >= args.warmup:
            passes.append(times)
    model.zero_grad(set_to_none=True)
    groups = len(planned)
    return {"tree_microbatches": groups - flat, "of": groups, "flat_microbatches": flat,
            "seconds": sum(min(ts) for ts in zip(*passes))}


def _cell(value, spec: str) -> str:
    """`value` formatted by `spec`, or "-" where a skipped mode left it out."""
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], header: dict, run: str) -> None:
    print(f"model {header['model']} ({header['active_params'] / 1e6:.0f}M active params/token), {header['dtype']} "
          f"on {header['device_name']}, capacity {header['capacity']}, {run}, attention "
          f"{header['attention']} ({header['attention_kernels']} kernels), modes {','.join(header['modes'])}")
    cols = ["workload", "S", "C", "compr", "attn cmp", "flat s", "tree s", "carry s", "plan s", "F/B/G x", "x/compr",
            "Core x", "carry x", "exec/trie", "flat GiB", "tree GiB", "carry GiB", "flat MFU", "auto x"]
    print(" ".join(f"{c:>9}" for c in cols))
    for r in rows:
        flat, tree, carry, auto = (r.get(k, {}) for k in ("flat", "tree", "carry", "auto"))
        vals = [r["workload"], f"{r['semantic_tokens']:,}", _cell(r.get("compact_tokens"), ","),
                _cell(r.get("compression"), ".2f"), _cell(r.get("attention_compression"), ".2f"),
                _cell(flat.get("seconds"), ".2f"), _cell(tree.get("seconds"), ".2f"),
                _cell(carry.get("seconds"), ".2f"), _cell(r.get("planning_seconds"), ".2f"),
                _cell(r.get("fbg_speedup"), ".2f"), _cell(r.get("fbg_over_compression"), ".2f"),
                _cell(r.get("core_speedup"), ".2f"), _cell(r.get("carry_speedup"), ".2f"),
                _cell(carry.get("executed_over_trie"), ".3f"),
                _cell(flat.get("peak_gib"), ".1f"), _cell(tree.get("peak_gib"), ".1f"),
                _cell(carry.get("peak_gib"), ".1f"), _cell(flat.get("mfu"), ".3f"), _cell(auto.get("speedup"), ".2f")]
        print(" ".join(f"{v:>9}" for v in vals))
    for r in rows:
        rates = [f"{mode} {r[key]:,.0f}" for mode, key in (("flat", "flat_tokens_per_s"),
                                                            ("tree", "tree_semantic_tokens_per_s")) if key in r]
        if "carry" in r:
            rates.append(f"carry {r['carry']['semantic_tokens_per_s']:,.0f}")
        line = f"{r['workload']}: tokens/s {', '.join(rates)} (semantic){mfu_text(r)}"
        if "carry" in r:
            c, duplicate = r["carry"], r.get("tree", {})
            line += (f"; carry executes {c['executed_rows']:,} rows in {c['microbatches']} microbatches against "
                     f"{c['trie_rows']:,} trie rows ({c['executed_over_trie']:.3f}x; duplicate "
                     f"{_cell(r.get('compact_tokens'), ',')} rows in {_cell(duplicate.get('microbatches'), 'd')}),"
                     f" carry plan {c['planning_seconds']:.2f} s")
        print(line)
        if "ceiling" in r:
            print(ceiling_line(r["workload"], r["ceiling"]))
        if "carry_ceiling" in r:
            print(ceiling_line(r["workload"], r["carry_ceiling"], "carry"))
        if "expansion" in r:
            e = r["expansion"]
            print(f"{r['workload']}: the heaviest flat microbatch ({e['tokens']:,} tokens) as a flat expansion through "
                  f"the tree path {e['seconds']:.2f} s, trajectory-wise {e['flat_seconds']:.2f} s")
    c = header["cost_model"]
    if c is not None:
        print(f"cost model: flat expansion {c['expansion_per_token'] * 1e6:.2f} us/token; tree "
              f"{c['tree_per_compact'] * 1e6:.2f} us/"
              f"compact row + {c['tree_per_view_row'] * 1e6:.2f} us/attention-view row"
              + (f", carry + {c['carry_per_context_row'] * 1e6:.2f} us/context row" if "carry_per_context_row" in c
                 else "") + "; auto runs a microbatch flat when that is cheaper than its trie and fits the capacity")
    print("attn cmp: how much the full-attention work (query-key pairs) shrinks; it bounds the speedup of the attention"
          " share of the time the way compr bounds the rest")
    print("tree = duplicate mode (HARTS plan); carry x = flat s / carry s; exec/trie = carry's executed rows (own "
          "compact rows of its microbatches) / the trie's rows")
    print("command: " + header["command"])


def mfu_text(row: dict) -> str:
    """The MFU of each mode that ran, 6 N only and with attention's products (bench.flops); the tree and carry on
    the rows they execute."""
    modes = [(mode, row[mode]) for mode in ("flat", "tree", "carry") if "mfu" in row.get(mode, {})]
    if not modes:
        return ""
    return ("; MFU " + ", ".join(f"{mode} {m['mfu']:.3f}" for mode, m in modes) + " (6 N per executed row), "
            + ", ".join(f"{mode} {m['mfu_attention']:.3f}" for mode, m in modes) + " with attention's products")


def run_variants(args: argparse.Namespace) -> list[tuple[str, bool, str, str]]:
    """The runs of one invocation, in order: (recompute option, fused row-wise kernels, attention kernel pair, label)
    for each `--recompute` option, once with the chosen row-wise kernels, or with the references and then fused under
    `--compare-rowwise`; once with `--attention-kernels`, or with flash and then fa4 under `--compare-attention`."""
    rowwise = [False, True] if args.compare_rowwise else [not args.reference_rowwise]
    pairs = list(CUDA_ATTENTION) if args.compare_attention else [args.attention_kernels]
    return [(text, fused, pair, f"recompute {text}"
             + (f", {'fused' if fused else 'reference'} row-wise" if args.compare_rowwise else "")
             + (f", {pair} attention" if args.compare_attention else ""))
            for pair in pairs for fused in rowwise for text in args.recompute]


def print_run_summary(rows: list[dict]) -> None:
    """One line per run (recompute option, row-wise and attention kernels) and workload: each mode's seconds and peak
    GiB; with several attention pairs, each mode's time with the first pair over its time with each other pair, run
    for run."""
    print("runs: seconds / peak GiB per mode")
    print(" ".join(f"{c:>13}" for c in ["workload", *MODE_KEYS]) + " run")
    for r in rows:
        cells = [f"{_cell(r.get(k, {}).get('seconds'), '.2f')} / {_cell(r.get(k, {}).get('peak_gib'), '.1f')}"
                 for k in MODE_KEYS]
        print(" ".join(f"{v:>13}" for v in [r["workload"], *cells]) + " " + r["run"])
    pairs = list(dict.fromkeys(r["attention_kernels"] for r in rows))
    for pair in pairs[1:]:
        for base in (r for r in rows if r["attention_kernels"] == pairs[0]):
            other = next(r for r in rows if r["attention_kernels"] == pair and r["workload"] == base["workload"]
                         and r["recompute"] == base["recompute"] and r["fused_rowwise"] == base["fused_rowwise"])
            ratios = [f"{k} {base[k]['seconds'] / other[k]['seconds']:.2f}x" for k in MODE_KEYS
                      if base.get(k, {}).get("seconds") and other.get(k, {}).get("seconds")]
            print(f"{base['workload']}: {pairs[0]} s / {pair} s: {', '.join(ratios)} ({other['run']})")


def recompute_option(text: str) -> str:
    """The argparse type of `--recompute` (bench.speed, bench.fidelity, bench.step_profile): `text`, once
    `models.recompute.parse_recompute_option` accepts it."""
    try:
        parse_recompute_option(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_modes(text: str) -> tuple[str, ...]:
    """`--modes`: a comma-separated subset of MODES, run in MODES' order."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"got {text!r}: name one or more of {', '.join(MODES)}, comma-separated")
    return tuple(m for m in MODES if m in names)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ling-3-tiny")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    parser.add_argument("--layers", type=int, default=None,
                        help="only the preset's first N layers (full widths and expert counts)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--scale", type=float, default=0.05, help="fraction of a full SWE-like step's paths")
    parser.add_argument("--token-scale", type=float, default=1.0, help="multiplies every generated length")
    parser.add_argument("--low-paths", type=int, default=64, help="paths of the low-sharing workload (0: skip)")
    parser.add_argument("--low-length", type=int, default=8192)
    parser.add_argument("--attention", default="branch", choices=["dense", "flex", "branch"])
    parser.add_argument("--modes", type=parse_modes, default=MODES,
                        help="comma-separated modes to time: flat, duplicate (the HARTS plan, reported as tree), carry")
    parser.add_argument("--ceiling", action="store_true",
                        help="CUDA, with flat and duplicate or carry: profile the heaviest flat and duplicate "
                             "microbatch and the whole carry step, and print their exact-execution ceilings "
                             "(bench.ceiling)")
    parser.add_argument("--no-auto", action="store_true",
                        help="skip what follows when flat and duplicate both run: timing the heaviest flat "
                             "microbatch as a flat expansion, the cost-model fit and the auto pass")
    parser.add_argument("--carry-resident", type=int, default=1,
                        help="carry: open microbatches whose activations stay on the GPU (planner.carry_resident)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes over all microbatches per mode")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; each microbatch counts its fastest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recompute", nargs="+", type=recompute_option, default=["full"], metavar="OPTION",
                        help="activation recomputation, one run per option: none, full (default), or "
                             "selective[:key=value,...] with the keys of [parallel.selective] (layers, part, every, "
                             "save; lists joined by +), e.g. selective:part=ffn,save=experts")
    parser.add_argument("--json", help="also write results to this file")
    add_kernel_cache_option(parser)
    add_kernel_choice_options(parser)
    parser.add_argument("--compare-rowwise", action="store_true",
                        help="run every --recompute option twice, side by side: with the reference row-wise ops, "
                             "then with the fused kernels (cuda)")
    parser.add_argument("--compare-attention", action="store_true",
                        help="run every option with each CUDA attention pair, side by side: flash, then fa4 "
                             "(cuda, bf16; fa4 needs flash-attn-4)")
    args = parser.parse_args(argv)
    if args.compare_attention and (args.device != "cuda" or args.dtype != "bfloat16"):
        parser.error("--compare-attention needs --device cuda and --dtype bfloat16: elsewhere every run takes the "
                     "reference attention")
    if args.compare_attention and args.attention_kernels != "auto":
        parser.error("--compare-attention runs every pair; leave out --attention-kernels")
    if args.compare_rowwise and args.reference_rowwise:
        parser.error("--compare-rowwise runs both row-wise paths; leave out --reference-rowwise")
    if args.compare_rowwise and args.device != "cuda":
        parser.error("--compare-rowwise needs --device cuda: off CUDA every run takes the reference row-wise ops")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    kernels = KernelSettings()
    if device.type == "cuda":
        kernels = kernel_choice(args, preset(args.model, args.layers).attention_shapes, open_kernel_cache(args))
        for pair in CUDA_ATTENTION if args.compare_attention else ():
            check_attention_pair(pair, "--compare-attention needs")  # every pair can run, before the first run
    torch.manual_seed(args.seed)
    config = dataclasses.replace(preset(args.model, args.layers), dtype=args.dtype)
    with torch.device(device):
        model = HybridForCausalLM(config, kernels)
    V = config.vocab_size
    workloads = [("swe", swe_like_step(args.seed, scale=args.scale, token_scale=args.token_scale, vocab_size=V,
                                       max_path_tokens=args.capacity))]
    if args.low_paths:
        workloads.append(("low-share", low_sharing_step(args.seed, args.low_paths, args.low_length, V)))
    rows, costs = [], []
    variants = run_variants(args)
    cuda_attention_runs = device.type == "cuda" and args.dtype == "bfloat16"  # else every run takes the reference
    for index, (text, fused, pair, label) in enumerate(variants):
        print(f"run {label}", file=sys.stderr, flush=True)
        model.set_activation_checkpointing(parse_recompute_option(text))
        if device.type == "cuda":
            model.use_kernels(dataclasses.replace(kernels, fused_rowwise=fused, attention=pair))
        measured = [run_workload(name, trajs, model, args, device) for name, trajs in workloads]
        cost = None
        if {"flat", "duplicate"} <= set(args.modes) and not args.no_auto:
            cost = fit_cost_model([state for _, state in measured])
            for row, state in measured:
                row["auto"] = run_auto(state, cost, model, args, device)
                row["auto"]["speedup"] = row["flat"]["seconds"] / row["auto"]["seconds"]
        for row, _ in measured:
            rows.append({**row, "recompute": text, "fused_rowwise": fused, "run": label,
                         "attention_kernels": pair if cuda_attention_runs else "reference",
                         "run_index": index})
        costs.append(cost)
    header = {
        "model": args.model, "layers": args.layers, "dtype": args.dtype, "capacity": args.capacity,
        "attention": args.attention,
        "attention_kernels": ",".join(dict.fromkeys(v[2] for v in variants)) if cuda_attention_runs else "reference",
        "modes": list(args.modes), "recompute": list(args.recompute), "carry_resident": args.carry_resident,
        "fused_rowwise": not args.reference_rowwise, "compare_rowwise": args.compare_rowwise,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "active_params": active_params(model),
        "cost_model": costs,
        "command": "python -m bench.speed " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    for index, ((*_, pair, label), cost) in enumerate(zip(variants, costs)):
        kernels = "reference" if header["attention_kernels"] == "reference" else pair
        print_table([r for r in rows if r["run_index"] == index],
                    {**header, "cost_model": cost, "attention_kernels": kernels}, label)
    if len(variants) > 1:
        print_run_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
