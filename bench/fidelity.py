"""Fidelity of tree execution: Arbor vs trajectory-wise execution on the same weights and trajectories.

    python -m bench.fidelity --model tiny-kimi-linear --device cpu --dtype float64 --json

Runs (1) the trajectory-wise reference: the model's flat packed forward over every trajectory separately, twice (the
rerun shows the reference's own run-to-run noise); (2) Arbor: pack -> minimum-call plan -> tree execution; (3) the
no-replay ablation: side branches start from the parent's state at the fork (no chunk-aligned replay); (4) the
reference again with the trajectories packed in reverse order (equally valid trajectory-wise training: in bf16 a
row's value can depend on the shapes of the calls it is part of, so this is the reference's own packing noise).
For (2)-(4) it reports, against (1): max |logprob diff|, |loss diff| of a per-token policy loss with random
advantages, max over parameters of ||g_tree - g_flat|| / ||g_flat||, |MoE aux loss diff|, the mean token-wise
full-vocabulary logit cosine (HARTS eq. 27), and per state-handoff depth the mean symmetric KL and mean |delta NLL|
(eqs. 24-26). With `--oracle`, the same metrics of (1), (2) and (4) against the same weights run flat in float64
(the question behind them: is tree execution less accurate than trajectory-wise execution?).

`--mode carry --capacity T` adds (5) prefix carry: `planner.carry.plan.plan_carry` cuts the trees into parts
over microbatches of at most T compact rows (one replica), `parallel.replica.prepare_step` prepares them and
`parallel.plain_runner.PlainRunner` runs them in the plan's event order; the top-level metrics are then carry's
(Arbor's single microbatch stays as the column "arbor"), with the same loss: the MoE aux loss of the whole step's
pooled router statistics, split into per-microbatch terms that are linear in each microbatch's statistics given the
step's expert counts and row weights (taken from a first carry pass, not timed), so loss and gradients are those of
the trajectory-wise objective. Depth = the handoff depth of the single-microbatch plan. `--per-layer` compares one
tree microbatch's layers and is skipped in carry mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
import torch

from bench.branching import nested_fork_trajectories
from bench.kernel_cache import add_kernel_cache_option, open_kernel_cache
from bench.kernel_choice import add_kernel_choice_options, kernel_choice
from bench.speed import recompute_option
from models.decoder import HybridForCausalLM
from models.dtypes import DTYPES, upcast
from models.hf_io import load_hf
from models.logprobs import compact_logprobs
from models.microbatch import Microbatch, prepare_microbatch
from models.moe import load_balancing_loss, pooled_stats, router_z_loss
from models.ops.settings import KernelSettings
from models.presets import preset
from models.recompute import parse_recompute_option
from models.tree.mixers import TreeContext
from parallel.plain_runner import PlainRunner
from parallel.replica import prepare_step
from planner.carry.plan import CarryPlan, plan_carry
from planner.jsonl import read_jsonl
from planner.pack import CompactBatch, pack

#: What the comparison runs in (float16 has no use here).
RUN_DTYPES = ("float64", "float32", "bfloat16")
POSITION_CHUNK = 2048


def build_model(args) -> HybridForCausalLM:
    if args.hf:
        model = load_hf(args.hf, dtype=DTYPES[args.dtype])
    else:
        config = preset(args.model, args.layers)
        if args.chunk_size and config.linear_attention is not None:
            config = dataclasses.replace(
                config, linear_attention=dataclasses.replace(config.linear_attention, chunk_size=args.chunk_size)
            )
        torch.manual_seed(args.seed)
        model = HybridForCausalLM(dataclasses.replace(config, dtype=args.dtype))
    return model.to(args.device)


def moe_aux(stats) -> torch.Tensor:
    p = pooled_stats(stats)
    if p is None:
        return torch.zeros((), dtype=torch.float64)
    return (load_balancing_loss(p) + router_z_loss(p)).double()


def semantic_logits_fn(hidden, rows, weight):
    """Chunked access to full-vocabulary logits (fp32, or fp64 for fp64 models) of semantic positions."""
    cdt = upcast(hidden.dtype)

    def get(lo, hi):
        return (hidden[rows[lo:hi]] @ weight.T).to(cdt)

    return get


@dataclasses.dataclass
class Run:
    logprobs: torch.Tensor  # [S] float64 (0 for first tokens)
    loss: torch.Tensor
    aux: torch.Tensor
    grads: list[torch.Tensor | None]
    logits: object  # (lo, hi) -> [hi-lo, V] logits at semantic positions' rows
    seconds: float


def objective(logprobs, aux, batch: CompactBatch, device):
    adv = torch.as_tensor(batch.advantage, dtype=torch.float64, device=device)
    mask = torch.as_tensor(batch.loss_mask, dtype=torch.float64, device=device)
    return -(adv * mask * logprobs).sum() / mask.sum().clamp(min=1) + 0.01 * aux


def packed_inputs(batch: CompactBatch, device, reverse: bool = False):
    """Flat packed inputs of the batch's trajectories (in batch order, or reversed): (ids [S], positions [S],
    cu_seqlens [N+1], unpack) where unpack [S] (or None) returns packed rows to semantic order."""
    order = np.arange(batch.num_trajectories)[::-1] if reverse else np.arange(batch.num_trajectories)
    offsets, lengths = batch.traj_offsets, batch.lengths
    perm = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in order])  # packed row -> semantic position
    as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)  # noqa: E731
    ids = as_t(batch.sem_tokens[perm])
    pos = as_t(np.concatenate([np.arange(lengths[i]) for i in order]))
    cu = as_t(np.concatenate([[0], np.cumsum(lengths[order])]))
    return ids, pos, cu, as_t(np.argsort(perm)) if reverse else None


def flat_run(model, batch: CompactBatch, device, reverse: bool = False, grads: bool = True) -> Run:
    """Trajectory-wise reference: every trajectory as its own packed sequence (in batch order, or reversed); logits of
    position s come from the hidden state of position s-1 of the same trajectory. `grads=False`: no backward."""
    start = time.perf_counter()
    ids_packed, pos, cu, unpack = packed_inputs(batch, device, reverse)
    with torch.set_grad_enabled(grads):
        out = model.hidden_states(ids_packed, pos, cu)
    if unpack is not None:
        out.hidden = out.hidden[unpack]
    ids = torch.as_tensor(batch.sem_tokens, device=device)
    S = ids.numel()
    valid = torch.as_tensor(batch.logit_row >= 0, device=device)
    prev = torch.arange(S, device=device) - 1
    prev = torch.where(valid, prev, torch.zeros_like(prev))
    logits = semantic_logits_fn(out.hidden, prev, model.lm_head_weight)
    lp = compact_logprobs(out.hidden, model.lm_head_weight, torch.where(valid, prev, -1), ids,
                          fused=model.kernels.fused_rowwise).double()
    aux = moe_aux(out.moe_stats)
    loss = objective(lp, aux, batch, device)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True) if grads else None
    _sync(device)
    return Run(lp.detach(), loss.detach(), aux.detach(), grads, logits, time.perf_counter() - start)


def tree_run(model, trajectories, device, replay: bool, backend: str) -> tuple[Run, Microbatch]:
    start = time.perf_counter()
    mb = prepare_microbatch(trajectories, model.config, device, replay=replay)
    batch, layout = mb.batches[0], mb.layout
    out = model.tree_hidden_states(TreeContext(layout, backend))
    valid = layout.logit_row >= 0
    rows = torch.where(valid, layout.logit_row, torch.zeros_like(layout.logit_row))
    logits = semantic_logits_fn(out.hidden, rows, model.lm_head_weight)
    lp = compact_logprobs(out.hidden, model.lm_head_weight, layout.logit_row, layout.target,
                          fused=model.kernels.fused_rowwise).double()
    aux = moe_aux(out.moe_stats)
    loss = objective(lp, aux, batch, device)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    _sync(device)
    return Run(lp.detach(), loss.detach(), aux.detach(), grads, logits, time.perf_counter() - start), mb


def carry_positions(batch: CompactBatch, plan: CarryPlan, step) -> list[np.ndarray]:
    """Per carry microbatch of replica 0's `step`, the positions of `batch` (the whole step packed) that its log-probs
    `[S_mb]` score."""
    offsets = batch.traj_offsets
    tree_map = [np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in tree])
                for tree in plan.replica(0).units]
    return [np.concatenate([tree_map[p.tree][s] for p, s in zip(mb.parts, mb.scored)]) for mb in step]


def carry_run(model, trajectories, batch: CompactBatch, capacity: int, device, backend: str
              ) -> tuple[Run, CarryPlan]:
    """Prefix carry over microbatches of at most `capacity` rows, with `objective`'s loss over the whole step: the
    policy term of each microbatch's positions plus 0.01 x its share of the step's aux loss, `E sum_e count_e
    mass_e / tokens^2 + z_sum / tokens` with the step's counts and tokens (a first pass) and its own mass and z_sum."""
    plan = plan_carry(trajectories, capacity, 1)
    runner = PlainRunner(model, attention_backend=backend)
    normalizer = float(np.sum(batch.loss_mask))
    adv = torch.as_tensor(batch.advantage, dtype=torch.float64, device=device)
    mask = torch.as_tensor(batch.loss_mask, dtype=torch.float64, device=device)

    def prepare():
        step = prepare_step(trajectories, plan, dp_rank=0, dp_group=None, model_config=model.config,
                            aggregation="token-mean", device=device)
        index = {id(mb): torch.as_tensor(i, device=device) for mb, i in zip(step, carry_positions(batch, plan, step))}
        return step, index

    step, index = prepare()
    totals = []

    def count(logprobs, mb, output):
        p = pooled_stats(output.moe_stats)
        if p is not None:
            totals.append((p.tokens.detach(), p.expert_counts.detach()))
        return 0.0 * logprobs.sum(), {}

    runner.train_step(step, count)
    model.zero_grad(set_to_none=True)
    tokens = sum(t for t, _ in totals) if totals else None
    counts = sum(c for _, c in totals) if totals else None
    S = batch.num_semantic
    lp_all = torch.zeros(S, dtype=torch.float64, device=device)
    rows_all = torch.zeros(S, dtype=torch.int64, device=device)
    hidden, aux, base = [], [], 0

    def loss_fn(logprobs, mb, output):
        nonlocal base
        i = index[id(mb)]
        lp = logprobs.double()
        loss = -(adv[i] * mask[i] * lp).sum() / max(normalizer, 1.0)
        p = pooled_stats(output.moe_stats)
        if p is not None:
            E = p.prob_mass.shape[0]
            share = (E * (counts * p.prob_mass).sum() / tokens**2 + p.z_sum / tokens).double()
            aux.append(share.detach())
            loss = loss + 0.01 * share
        lp_all[i] = lp.detach()
        valid = mb.layout.logit_row >= 0
        rows_all[i] = torch.where(valid, mb.layout.logit_row + base, torch.zeros_like(mb.layout.logit_row))
        hidden.append(output.hidden.detach())
        base += output.hidden.shape[0]
        return loss, {}

    start = time.perf_counter()
    step, index = prepare()
    result = runner.train_step(step, loss_fn)
    _sync(device)
    seconds = time.perf_counter() - start
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    logits = semantic_logits_fn(torch.cat(hidden), rows_all, model.lm_head_weight)
    aux_total = sum(aux) if aux else torch.zeros((), dtype=torch.float64)
    return Run(lp_all, torch.tensor(result.loss, dtype=torch.float64), aux_total, grads, logits, seconds), plan


def float64_run(model, batch: CompactBatch, device) -> Run:
    """The flat reference with the same weights in float64 (reference kernels), forward only: a float64 copy of a
    large model and its gradients would not fit next to the low-precision runs (ling-3-tiny: 7.8B parameters)."""
    with torch.device(device):
        oracle = HybridForCausalLM(dataclasses.replace(model.config, dtype="float64"), model.kernels)
    oracle.load_state_dict(model.state_dict())
    return flat_run(oracle, batch, device, grads=False)


def layer_outputs(model, forward) -> list[torch.Tensor]:
    """Every decoder layer's output rows during `forward()` (run without gradients)."""
    captured = []
    hooks = [layer.register_forward_hook(lambda m, i, o: captured.append(o[0])) for layer in model.model.layers]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in hooks:
            h.remove()
    return captured


def per_layer_divergence(model, mb: Microbatch, backend: str, device) -> list[dict]:
    """Per decoder layer, the fraction of semantic positions whose layer output is not bitwise equal to the flat
    reference's, by the position's handoff depth: for Arbor and for the reference packed in reverse order. Locates
    where (layer, depth) a low-precision tree run first departs from the reference, and how it spreads."""
    batch, plan = mb.batches[0], mb.call_plan
    ids, pos, cu, _ = packed_inputs(batch, device)
    flat = layer_outputs(model, lambda: model.hidden_states(ids, pos, cu))
    ids_r, pos_r, cu_r, unpack = packed_inputs(batch, device, reverse=True)
    repacked = [x[unpack] for x in layer_outputs(model, lambda: model.hidden_states(ids_r, pos_r, cu_r))]
    sem_rows = torch.as_tensor(plan.compact_to_physical[batch.sem_to_compact], device=device)
    ctx = TreeContext(mb.layout, backend)
    tree = [x[sem_rows] for x in layer_outputs(model, lambda: model.tree_hidden_states(ctx))]
    depth = torch.as_tensor(plan.handoff_depth[batch.sem_to_compact], device=device)
    depths = torch.unique(depth).tolist()

    def differing(a, b):
        neq = (a != b).any(-1)
        return {str(d): neq[depth == d].float().mean().item() for d in depths}

    return [
        {"layer": i, "type": model.config.layer_types[i], "arbor": differing(t, f), "flat_repacked": differing(r, f)}
        for i, (f, r, t) in enumerate(zip(flat, repacked, tree))
    ]


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def compare(ref: Run, other: Run, depth: np.ndarray, valid: torch.Tensor, targets: torch.Tensor) -> dict:
    grad_rel = 0.0 if ref.grads is not None and other.grads is not None else None
    for a, b in zip(other.grads or (), ref.grads or ()):
        if b is None or a is None:
            continue
        grad_rel = max(grad_rel, ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item())
    S = valid.numel()
    cos_sum, n_valid = 0.0, 0
    D = int(depth.max(initial=0)) + 1
    symkl = np.zeros(D)
    dnll = np.zeros(D)
    count = np.zeros(D)
    depth_t = torch.as_tensor(depth, device=valid.device)
    with torch.no_grad():
        for lo in range(0, S, POSITION_CHUNK):
            hi = min(lo + POSITION_CHUNK, S)
            keep = valid[lo:hi]
            if not keep.any():
                continue
            za, zx = ref.logits(lo, hi)[keep].double(), other.logits(lo, hi)[keep].double()
            cos_sum += torch.nn.functional.cosine_similarity(za, zx, dim=-1).sum().item()
            n_valid += int(keep.sum())
            la, lx = torch.log_softmax(za, -1), torch.log_softmax(zx, -1)
            kl_ax = (la.exp() * (la - lx)).sum(-1)
            kl_xa = (lx.exp() * (lx - la)).sum(-1)
            y = targets[lo:hi][keep]
            d_nll = (la.gather(1, y[:, None]) - lx.gather(1, y[:, None]))[:, 0].abs()
            d = depth_t[lo:hi][keep]
            for k in torch.unique(d).tolist():
                sel = d == k
                symkl[k] += (0.5 * (kl_ax[sel] + kl_xa[sel])).sum().item()
                dnll[k] += d_nll[sel].sum().item()
                count[k] += int(sel.sum())
    by = lambda arr: {str(k): arr[k] / count[k] for k in range(D) if count[k]}  # noqa: E731
    return {
        "logprob_max_abs_diff": (other.logprobs - ref.logprobs).abs().max().item(),
        "loss_abs_diff": abs(other.loss.item() - ref.loss.item()),
        "grad_max_rel_diff": grad_rel,
        "moe_aux_abs_diff": abs(other.aux.item() - ref.aux.item()),
        "mean_logit_cosine": cos_sum / max(n_valid, 1),
        "symkl_by_depth": by(symkl),
        "mean_abs_dnll_by_depth": by(dnll),
        "seconds": other.seconds,
    }


def run(args, kernels: KernelSettings = KernelSettings()) -> dict:
    """The comparison for the parsed arguments; `kernels`: GPU runs' kernel settings from `--kernel-cache`
    (`bench.kernel_cache.open_kernel_cache`), to which the kernel flags are added for the model."""
    device = torch.device(args.device)
    model = build_model(args)
    if device.type == "cuda":
        model.use_kernels(kernel_choice(args, model.config.attention_shapes, kernels))
    model.set_activation_checkpointing(parse_recompute_option(args.recompute))
    chunk = model.config.chunk_size
    if args.trajectories:
        trajectories = read_jsonl(args.trajectories)
        source = args.trajectories
    else:
        rng = np.random.default_rng(args.seed)
        trajectories = nested_fork_trajectories(rng, chunk, model.config.vocab_size, depth=args.depth,
                                                tail=args.tail or chunk, trees=args.trees)
        source = f"generated (seed {args.seed}, depth {args.depth})"
    for i, t in enumerate(trajectories):
        if t.tokens.max() >= model.config.vocab_size:
            raise ValueError(f"trajectory {i} holds token id {t.tokens.max()} >= vocab_size {model.config.vocab_size}")
    batch = pack(trajectories)
    valid = torch.as_tensor(batch.logit_row >= 0, device=device)
    targets = torch.as_tensor(batch.sem_tokens, device=device)

    ref = flat_run(model, batch, device)
    runs, metrics = {}, {}

    def measure(name, run_):
        """Compare with the reference now and keep only what later comparisons read (not the gradients)."""
        metrics[name] = compare(ref, run_, depth, valid, targets)
        run_.grads = None
        runs[name] = run_

    arbor, mb = tree_run(model, trajectories, device, True, args.attention)
    # Handoff depth of the row whose logits predict each position (the previous position's row).
    depth = mb.call_plan.handoff_depth[np.where(batch.logit_row >= 0, batch.logit_row, 0)]
    measure("arbor", arbor)
    primary = "arbor"
    if args.mode == "carry":
        carried, plan = carry_run(model, trajectories, batch, args.capacity, device, args.attention)
        measure("carry", carried)
        primary = "carry"
    measure("no_replay", tree_run(model, trajectories, device, False, args.attention)[0])
    measure("flat_rerun", flat_run(model, batch, device))
    measure("flat_repacked", flat_run(model, batch, device, reverse=True))
    ref.grads = None
    oracle = float64_run(model, batch, device) if args.oracle else None
    per_layer = args.per_layer and args.mode == "tree"
    if per_layer:
        divergence = per_layer_divergence(model, mb, args.attention, device)
    elif args.per_layer:
        print("note: --per-layer skipped: it compares one tree microbatch's layer outputs (run it with --mode tree)",
              file=sys.stderr)
    result = {
        "model": args.hf or args.model,
        "layers": args.layers,
        "device": args.device,
        "dtype": args.dtype,
        "mode": args.mode,
        "chunk_size": chunk,
        "recompute": args.recompute,
        # the CUDA pairs run bf16/fp16 tensors only (models.ops.varlen_attention.varlen_kernels)
        "attention_kernels": (args.attention_kernels if device.type == "cuda" and args.dtype in ("bfloat16", "float16")
                              else "reference"),
        "trajectories": source,
        "num_trajectories": batch.num_trajectories,
        "semantic_tokens": batch.num_semantic,
        "compact_tokens": batch.num_compact,
        "num_rounds": mb.call_plan.num_rounds,
        "total_replay": mb.call_plan.total_replay,
        "max_handoff_depth": int(mb.call_plan.handoff_depth.max()),
        **metrics[primary],
        **{name: metrics[name] for name in ("flat_rerun", "flat_repacked", "no_replay")},
        "command": "python -m bench.fidelity " + " ".join(sys.argv[1:]),
    }
    if args.mode == "carry":
        result["arbor"] = metrics["arbor"]
        result["carry"] = {
            "capacity": args.capacity, "microbatches": len(plan.microbatches),
            "parts": sum(len(m.parts) for m in plan.microbatches), "trees": len(plan.trees),
            "executed_rows": plan.total_compact_tokens, "trie_rows": plan.trie_compact_tokens,
            "max_context_rows": plan.max_context_rows, "max_open_microbatches": plan.max_open_microbatches,
        }
    if per_layer:
        result["per_layer_not_bitwise"] = divergence
    if oracle is not None:
        compared = [("flat", ref), *((n, runs[n]) for n in dict.fromkeys(("arbor", primary))),
                    ("flat_repacked", runs["flat_repacked"])]
        result["vs_float64"] = {name: compare(oracle, r, depth, valid, targets) for name, r in compared}
    return result


def print_table(r: dict) -> None:
    print(f"{r['model']} on {r['device']} in {r['dtype']}, chunk {r['chunk_size']}, recompute {r['recompute']}, "
          f"attention kernels {r['attention_kernels']}")
    print(f"{r['num_trajectories']} trajectories, S={r['semantic_tokens']}, C={r['compact_tokens']}, "
          f"{r['num_rounds']} rounds, replay {r['total_replay']}, handoff depth <= {r['max_handoff_depth']}")
    primary = "carry" if r["mode"] == "carry" else "arbor"
    if primary == "carry":
        c = r["carry"]
        print(f"carry: capacity {c['capacity']}, {c['trees']} trees in {c['parts']} parts over {c['microbatches']} "
              f"microbatches, executed rows {c['executed_rows']} (trie {c['trie_rows']}), context <= "
              f"{c['max_context_rows']} rows, <= {c['max_open_microbatches']} microbatches open")
    keys = ["logprob_max_abs_diff", "loss_abs_diff", "grad_max_rel_diff", "moe_aux_abs_diff", "mean_logit_cosine"]
    def cell(d, k):
        if d[k] is None:
            return f"{'-':>14}"
        return f"{d[k]:>14.8f}" if k == "mean_logit_cosine" else f"{d[k]:>14.4e}"

    others = ("arbor", "no_replay", "flat_rerun", "flat_repacked") if primary == "carry" else (
        "no_replay", "flat_rerun", "flat_repacked")
    columns = {"vs flat": {primary: r, **{n: r[n] for n in others}}}
    if "vs_float64" in r:
        columns["vs float64 flat"] = r["vs_float64"]
    for title, runs in columns.items():
        print(f"{title:<24}" + "".join(f"{n:>14}" for n in runs))
        for k in keys:
            print(f"{k:<24}" + "".join(cell(d, k) for d in runs.values()))
    floor = r["flat_rerun"]["mean_logit_cosine"] - 1e-5
    label = "carry" if primary == "carry" else "tree"
    print(f"{label}-vs-flat cosine {r['mean_logit_cosine']:.8f} vs flat rerun's minus 1e-5 ({floor:.8f}): "
          + ("not lower" if r["mean_logit_cosine"] >= floor else "LOWER"))
    runs = {primary: r, **({"arbor": r["arbor"]} if primary == "carry" else {}), "no_replay": r["no_replay"],
            "repacked": r["flat_repacked"]}
    if "vs_float64" in r:
        runs.update({"flat|f64": r["vs_float64"]["flat"], f"{primary}|f64": r["vs_float64"][primary]})
    print(f"{'depth':<8}" + "".join(f"{'symkl ' + n:>18}" for n in runs) + f"{'|dNLL| ' + primary:>14}")
    for d in r["symkl_by_depth"]:
        print(f"{d:<8}" + "".join(f"{x['symkl_by_depth'].get(d, float('nan')):>18.3e}" for x in runs.values())
              + f"{r['mean_abs_dnll_by_depth'][d]:>14.3e}")
    for row in r.get("per_layer_not_bitwise", []):
        if row["layer"] == 0:
            print("rows not bitwise equal to flat, by handoff depth: layer type | arbor | flat repacked")
        fmt = lambda d: " ".join(f"{v:.3f}" for v in d.values())  # noqa: E731
        print(f"{row['layer']:>3} {row['type'][:6]:<7}| {fmt(row['arbor'])} | {fmt(row['flat_repacked'])}")
    print(r["command"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="tiny-qwen3-next", help="model preset (random init)")
    source.add_argument("--hf", help="local Hugging Face checkpoint directory")
    parser.add_argument("--layers", type=int, default=None,
                        help="only the preset's first N layers (full widths and expert counts)")
    parser.add_argument("--trajectories", help="TRAJ.jsonl (default: generated nested-fork trees)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float64", choices=RUN_DTYPES)
    parser.add_argument("--chunk-size", type=int, default=None, help="linear-attention chunk size (preset default)")
    parser.add_argument("--recompute", nargs="?", type=recompute_option, const="full", default="none",
                        metavar="OPTION",
                        help="activation recomputation in every run (same forward numerics): none (default), full "
                             "(also a bare --recompute) or selective[:key=value,...] as in bench.speed")
    parser.add_argument("--attention", default="dense", choices=["dense", "flex", "branch"],
                        help="tree attention backend")
    parser.add_argument("--oracle", action="store_true",
                        help="also compare flat, Arbor and repacked flat against a float64 flat run of the same "
                             "weights")
    parser.add_argument("--per-layer", action="store_true",
                        help="per layer and handoff depth: rows whose output is not bitwise equal to flat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=int, default=5, help="nested forks per generated tree")
    parser.add_argument("--tail", type=int, default=None, help="new tokens per generated branch (default: one chunk)")
    parser.add_argument("--trees", type=int, default=1, help="generated trees")
    parser.add_argument("--mode", default="tree", choices=["tree", "carry"],
                        help="tree: Arbor as one microbatch; carry: also prefix carry over microbatches of --capacity")
    parser.add_argument("--capacity", type=int, default=None, help="compact rows per carry microbatch (--mode carry)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_kernel_cache_option(parser)
    add_kernel_choice_options(parser)
    args = parser.parse_args(argv)
    if args.mode == "carry" and (args.capacity is None or args.capacity < 1):
        parser.error(f"--mode carry needs --capacity T >= 1 (compact rows per microbatch), got {args.capacity}")
    if args.mode == "tree" and args.capacity is not None:
        parser.error("--capacity splits trees over carry microbatches: add --mode carry (or drop --capacity)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.oracle and args.dtype == "float64":
        parser.error("--oracle compares against float64: run it with --dtype float32 or bfloat16")
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1 (omit it for the model's own), got {args.chunk_size}")
    kernels = open_kernel_cache(args) if args.device == "cuda" else KernelSettings()
    try:
        result = run(args, kernels)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
