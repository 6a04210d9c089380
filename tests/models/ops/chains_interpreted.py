"""The chain kernels (`models.ops.kda.chains`) against their plain-torch reference (`models.ops.kda.naive_chains`) on
CPU tensors, run by Triton's interpreter: `TRITON_INTERPRET=1 python -m tests.models.ops.chains_interpreted` (the
variable must be set before Triton decorates any kernel, so `test_kda_calls.py` runs this in a fresh process).

Every round of the layer calls of `kda_calls_cases` (sequences dropping out of later calls, continuing, uncut; from
outside states or zeros; a second round whose two sequences share a start), forward round by round and backward in
reverse with the initial-state gradients added between rounds as `models.ops.kda.calls` adds them; head dims with one
full block of 64 and with four partial ones, more value heads than key heads. fp32. Prints one JSON line: for each
case the largest difference of each output relative to the reference's largest magnitude.
"""

import json
import os

import torch

from models.ops.kda.calls import _add_initial_gradients
from models.ops.kda.chains import bwd_dhu_chains, fwd_h_chains
from models.ops.kda.naive_chains import naive_bwd_dhu_chains, naive_fwd_h_chains
from models.tree.layout import CoreCalls
from tests.models.ops.kda_calls_cases import B, ROUNDS, layer_calls

SHAPES = {"K=64, V=64": (1, 2, 64, 64), "K=200, V=48": (2, 4, 200, 48)}  # (H, HV, K, V)


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


def run_case(pieces, outside: bool, side: bool, shape) -> dict[str, float]:
    H, HV, K, V = shape
    calls = CoreCalls.build(layer_calls(pieces, outside, side), B, 4 if outside else 1)
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
            fwd(h, v_new, k, w, u, gk, tab, chains, B, store_states=True)
        h_again = torch.full_like(h, float("nan"))
        for chains in calls.chains:  # as backward's recomputation: the table the forward filled, not written
            fwd(h_again, torch.empty_like(v_new), k, w, u, gk, tab, chains, B, store_states=False)
        dh, dv2, d_tab = torch.full_like(h, float("nan")), torch.full_like(dv, float("nan")), d_table.clone()
        for chains in reversed(calls.chains):
            _add_initial_gradients(d_tab, chains.grad_entries, bwd(dh, dv2, q, k, w, do, dv, gk, d_tab, 0.7, chains, B))
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
            for side in (True, False):
                for shape_name, shape in SHAPES.items():
                    key = f"{name}, {'outside' if outside else 'zeros'}, {'side' if side else 'one round'}, {shape_name}"
                    report[key] = run_case(pieces, outside, side, shape)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
