"""The chain kernels (`models.ops.kda.chains`) against their plain-torch reference (`models.ops.kda.naive_chains`) on
CPU tensors, run by Triton's interpreter: `TRITON_INTERPRET=1 python -m tests.models.ops.chains_interpreted` (the
variable must be set before Triton decorates any kernel, so `test_kda_chains.py` runs this in a fresh process).

The layer calls of `kda_calls_cases` (sequences dropping out of later calls, continuing, uncut; from outside states
or zeros; then no second round, one whose two sequences share a start, or one of three sequences where two share a
start, one starts from zeros and one continues over two calls) and two planner plans, forward round by round and
backward in reverse with the initial-state gradients added between rounds as `models.ops.kda.tree_calls` adds them. Head
dims: one block of 64 (every layout), two (the plans) and four partial ones (the three-sequence rounds); more value
heads than key heads; chunks of 64 and 16. fp32. Prints one JSON line: for each case the largest difference of each
output relative to the reference's largest magnitude, and how far the recomputation's chunk states are from the
forward's.
"""

import json
import os

import torch

from models.ops.kda.chains import bwd_dhu_chains, fwd_h_chains
from models.ops.kda.naive_chains import naive_bwd_dhu_chains, naive_fwd_h_chains
from models.ops.kda.tree_calls import _add_initial_gradients
from models.tree.core_calls import core_calls
from models.tree.layout import CoreCalls
from tests.models.ops.kda_calls_cases import ROUNDS, B, chained_side_calls, layer_calls
from tests.models.tree.test_core_calls import make_plan

SHAPES = {"K=64, V=64": (1, 2, 64, 64), "K=200, V=48": (2, 4, 200, 48)}  # (H, HV, K, V)
CONFIG = {"BV": 32, "num_warps": 4, "num_stages": 3}  # the interpreter reads only BV


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


def run_case(calls: CoreCalls, chunk: int, shape) -> dict[str, float]:
    H, HV, K, V = shape
    T, NT, M = sum(calls.call_rows), calls.chunk_bounds[-1], calls.table_size
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = rand(1, T, H, K) * K**-0.5, rand(1, T, H, K) * K**-0.5
    w, u = rand(1, T, HV, K) * K**-0.5, rand(1, T, HV, V)
    gk = -torch.rand(1, T, HV, K, generator=gen) * 0.2
    do, dv = rand(1, T, HV, V), rand(1, T, HV, V)
    table = rand(M, HV, K, V)
    table[0] = 0
    d_table = rand(M, HV, K, V)

    out = {}
    results = []
    for fwd, bwd in ((fwd_h_chains, bwd_dhu_chains), (naive_fwd_h_chains, naive_bwd_dhu_chains)):
        h, v_new = torch.full((1, NT, HV, K, V), float("nan")), torch.full_like(u, float("nan"))
        tab = table.clone()
        for chains in calls.chains:
            fwd(h, v_new, k, w, u, gk, tab, chains, chunk, True, CONFIG)
        h_again = torch.full_like(h, float("nan"))
        for chains in calls.chains:  # as backward's recomputation: the table the forward filled, not written
            fwd(h_again, torch.empty_like(v_new), k, w, u, gk, tab, chains, chunk, False, CONFIG)
        dh, dv2, d_tab = torch.full_like(h, float("nan")), torch.full_like(dv, float("nan")), d_table.clone()
        for chains in reversed(calls.chains):
            dh0 = bwd(dh, dv2, q, k, w, do, dv, gk, d_tab, 0.7, chains, chunk, CONFIG)
            _add_initial_gradients(d_tab, chains.grad_entries, dh0)
        results.append(dict(h=h, v_new=v_new, table=tab, dh=dh, dv2=dv2, d_table=d_tab))
        out["recomputation's h - forward's"] = max(out.get("recomputation's h - forward's", 0.0),
                                                   float((h_again - h).abs().max()))
    chains_run, reference = results
    out.update({name: _relative(chains_run[name], reference[name]) for name in reference})
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (see the module docstring)"
    report = {}
    for name, pieces in ROUNDS.items():
        for outside in (True, False):
            for side in ("side", "one round", "chained side"):
                calls = chained_side_calls(pieces, outside) if side == "chained side" else \
                    layer_calls(pieces, outside, side == "side")
                layout = CoreCalls.build(calls, B, 4 if outside else 1)
                for shape_name, shape in SHAPES.items() if side == "chained side" else list(SHAPES.items())[:1]:
                    key = f"{name}, {'outside' if outside else 'zeros'}, {side}, {shape_name}"
                    report[key] = run_case(layout, B, shape)
    for seed in (0, 7):  # planner plans: 5 and 6 calls in 2 rounds, side branches sharing starts; chunk 16, K=128
        _, plan = make_plan(seed, chunk=16)
        layout = CoreCalls.build(core_calls(plan)[0], 16, 1 + plan.external_state_context.size)
        report[f"plan {seed}, chunk 16, K=128, V=32"] = run_case(layout, 16, (1, 1, 128, 32))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
