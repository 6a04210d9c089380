"""Packed causal attention backends on one step's real shapes: the flat microbatch and the tree's branch views.

    python -m bench.attention [--seed 5] [--scale 0.01] [--capacity 65536] [--repeat 5]
                              [--backends flash,varlen,flex] [--model ling-3-tiny]

Cases, from one SWE-like step (`bench.workloads.swe_like_step`):
- flat: the fullest first-fit microbatch (`bench.speed.first_fit_flat`), causal inside each trajectory;
- tree: the duplicate-mode microbatch with the most compact rows (`models.microbatch.prepare_microbatch`); each
  branch's queries over its gathered ancestors and itself, bottom-right (`models.tree.branch_attention`).
Backends:
- flash: torch's varlen FlashAttention-2 (`aten::_flash_attention_forward` / `_backward`), v zero-padded to the q/k
  head dim;
- varlen: `torch.nn.attention.varlen.varlen_attn` (flat only; v padded), the public API over flash's kernels;
- flex: compiled FlexAttention with the block mask of `models.tree.attention` (flat: a chain per trajectory;
  tree: the ancestor mask), v padded on CUDA;
- fa4 (not in the default list): training's calls (as flash) with FlashAttention-4's pair
  (`models.ops.varlen_attention.fa4`, the flash-attn-4 package's CuTe-DSL kernels, Hopper forward and backward),
  a value head dim of its own where its Hopper backward takes one (`fa4.native_values`: ling-3-tiny's 192/128), else
  padded as flash;
- reference (not in the default list): the float32 references (flat: `varlen_attention`'s reference kernels; tree:
  the dense mask of `models.tree.attention`), the only one that runs on CPU with backward.
flash and fa4 run the very calls of training (flat: `models.ops.varlen_attention.varlen_attention`; tree:
`branch_attention`) with their kernel pair. Shapes are the model's full attention (ling-3-tiny: 16 heads, q/k 192,
v 128), bf16.

Per case and backend: forward and forward+backward milliseconds (median of `--repeat` after one warm-up that
compiles), the peak memory above the inputs of forward+backward, the largest absolute difference over out, dq, dk and
dv against the float32 reference on the small case (the same step at token scale 0.01) and against flash on the real
shapes. A backend that cannot run a case prints one reason line and the table goes on.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from bench.speed import first_fit_flat
from bench.workloads import swe_like_step
from models.microbatch import prepare_microbatch
from models.ops.varlen_attention import check_cuda_attention, varlen_attention
from models.ops.varlen_attention.fa4 import native_values
from models.presets import preset
from models.tree.attention import TreeAttentionLayout, tree_attention
from models.tree.branch_attention import branch_attention
from planner.microbatch.plan import plan_microbatches

BACKENDS = ("flash", "varlen", "flex")
#: What `--backends` may name: BACKENDS, FlashAttention-4 (a separate package) and the reference (O(rows^2) memory in
#: the tree: small cases only).
CHOICES = (*BACKENDS, "fa4", "reference")
#: Token scale of the small case whose results are compared with the float32 reference (or `--token-scale` if less).
SMALL_TOKEN_SCALE = 0.01

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Case:
    """One packed attention problem: Q query rows over the key rows of their sequences or views."""

    name: str
    queries: int
    key_rows: int
    kernels: Callable[[str], Attention]
    """Training's attention over this case with a CUDA kernel pair (flat: `varlen_attention`; tree:
    `branch_attention`)."""
    reference: Attention
    """Float32 reference on the case's structure."""
    flex_layout: TreeAttentionLayout
    cu: torch.Tensor | None = None
    """Flat only: the trajectories' offsets (`varlen`)."""
    max_len: int = 0


@dataclass(frozen=True)
class Shapes:
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int


def model_shapes(name: str) -> Shapes:
    """The full-attention shapes of preset `name` (MLA or gated GQA)."""
    attn = preset(name).full_attention
    if attn is None:
        raise ValueError(f"preset {name!r} has no full-attention layers")
    if hasattr(attn, "qk_head_dim"):
        return Shapes(attn.num_heads, attn.num_heads, attn.qk_head_dim, attn.v_head_dim)
    return Shapes(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.head_dim)


def chain_layout(cu: torch.Tensor) -> TreeAttentionLayout:
    """Flat packed causal attention as a tree layout of one chain per sequence: row k is an ancestor-or-self of row q
    iff k <= q < end of k's sequence (the flex backend's block mask)."""
    lengths = cu.diff()
    rows = torch.arange(int(cu[-1]), device=cu.device)
    end = torch.repeat_interleave(cu[1:], lengths)
    return TreeAttentionLayout(rows, end, rows[:0], [])


def flat_case(lengths: list[int], device) -> Case:
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    m = max(lengths)

    def kernels(pair: str) -> Attention:
        return lambda q, k, v: varlen_attention(q, k, v, cu, cu, m, m, q.shape[-1] ** -0.5, pair)

    # In float32 `varlen_attention` runs the reference kernels (models.ops.varlen_attention.naive).
    return Case("flat", sum(lengths), sum(lengths), kernels=kernels, reference=kernels("flash"),
                flex_layout=chain_layout(cu), cu=cu, max_len=m)


def tree_case(trajectories, model: str, device) -> Case:
    mb = prepare_microbatch(trajectories, preset(model), device)
    layout = mb.layout.attention
    return Case(
        "tree", mb.num_compact, int(layout.kv_index.numel()),
        kernels=lambda pair: lambda q, k, v: branch_attention(q, k, v, layout.kv_index, layout.groups,
                                                             q.shape[-1] ** -0.5, pair),
        reference=lambda q, k, v: tree_attention(q, k, v, layout, q.shape[-1] ** -0.5, "dense"),
        flex_layout=layout,
    )


def step_cases(seed: int, scale: float, token_scale: float, capacity: int, model: str, device) -> list[Case]:
    """The flat and the tree case of one SWE-like step (module docstring)."""
    trajs = swe_like_step(seed, scale=scale, token_scale=token_scale, vocab_size=1000, max_path_tokens=capacity)
    groups = first_fit_flat(trajs, capacity)
    fullest = max(groups, key=lambda g: sum(len(trajs[i]) for i in g))
    heaviest = max(plan_microbatches(trajs, capacity, 1).microbatches, key=lambda mb: mb.compact_tokens)
    return [flat_case([len(trajs[i]) for i in fullest], device),
            tree_case([trajs[i] for i in heaviest.trajectories], model, device)]


def _varlen_attn(case: Case) -> Attention:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def run(q, k, v):
        K, V = q.shape[-1], v.shape[-1]
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        out = varlen_attn(q, k, F.pad(v, (0, K - V)), case.cu, case.cu, case.max_len, case.max_len, scale=K**-0.5,
                          **causal, **gqa)
        return out[..., :V]

    return run


def backend_attention(name: str, case: Case, device) -> Attention:
    """`name`'s attention over `case`; raises RuntimeError with the reason when it cannot run it here."""
    if name == "flex":
        return lambda q, k, v: tree_attention(q, k, v, case.flex_layout, q.shape[-1] ** -0.5, "flex")
    if name == "reference":
        return case.reference
    if device.type != "cuda":
        raise RuntimeError("needs CUDA")
    if name == "varlen":
        if case.cu is None:
            raise RuntimeError("the branch views run torch's varlen kernels through flash (same kernels as flash)")
        return _varlen_attn(case)
    check_cuda_attention(name)  # raises here, with the reason, if the pair cannot run
    return case.kernels(name)


def _inputs(case: Case, shapes: Shapes, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    rows = case.queries + case.flex_layout.context_rows

    def randn(n, h, d):
        return torch.randn(n, h, d, generator=g, device=device, dtype=dtype)

    q = randn(case.queries, shapes.heads, shapes.qk_dim)
    k, v = randn(rows, shapes.kv_heads, shapes.qk_dim), randn(rows, shapes.kv_heads, shapes.v_dim)
    return q, k, v, randn(case.queries, shapes.heads, shapes.v_dim)


def results(fn: Attention, q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of `fn` at (q, k, v) with output gradient `dout`."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def max_abs_diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], repeat: int, device) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(fn: Attention, inputs, repeat: int, device) -> dict:
    """Forward and forward+backward milliseconds and peak bytes above the inputs (CUDA) of `fn`, after a warm-up."""
    q, k, v, dout = inputs
    results(fn, q, k, v, dout)
    with torch.no_grad():
        fwd = median_ms(lambda: fn(q, k, v), repeat, device)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    both = median_ms(lambda: results(fn, q, k, v, dout), repeat, device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "peak_bytes": peak}


def backend_note(name: str, shapes: Shapes, device) -> str:
    """What a row's numbers include beyond the attention itself: value padding, torch's own kernel choice."""
    notes = []
    pads = name in ("flash", "varlen") or (name == "flex" and device.type == "cuda") or (
        name == "fa4" and not native_values(torch.empty(0, shapes.heads, shapes.qk_dim),
                                            torch.empty(0, shapes.kv_heads, shapes.v_dim)))
    if pads and shapes.v_dim < shapes.qk_dim:
        notes.append(f"v padded {shapes.v_dim}->{shapes.qk_dim}")
    if name == "varlen":
        from torch.nn.attention import varlen

        use_cudnn = getattr(varlen, "_should_use_cudnn", None)
        if use_cudnn is not None:
            notes.append("torch picks " + ("cudnn" if use_cudnn(device.index or 0) else "flash"))
    return "; ".join(notes)


def run(args, device) -> list[dict]:
    shapes = model_shapes(args.model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    real = step_cases(args.seed, args.scale, args.token_scale, args.capacity, args.model, device)
    small = step_cases(args.seed, args.scale, min(SMALL_TOKEN_SCALE, args.token_scale), args.capacity, args.model,
                       device)
    rows = []
    for case, small_case in zip(real, small):
        inputs = _inputs(case, shapes, dtype, device)
        small_inputs = _inputs(small_case, shapes, dtype, device, seed=1)
        reference = results(small_case.reference, *(x.float() for x in small_inputs))
        baseline = None
        for name in args.backends:
            try:
                fn = backend_attention(name, case, device)
                small_err = max_abs_diff(results(backend_attention(name, small_case, device), *small_inputs),
                                         reference)
                got = results(fn, *inputs)
                row = {"case": case.name, "backend": name, "queries": case.queries, "key_rows": case.key_rows,
                       **measure(fn, inputs, args.repeat, device), "ref_err": small_err,
                       "note": backend_note(name, shapes, device)}
            except (RuntimeError, NotImplementedError, ValueError) as e:
                # A backend's refusal (or missing kernel) is a result of this benchmark; on CUDA flash is the baseline
                # the others are compared with, so its failure there is a failure.
                if name == "flash" and device.type == "cuda":
                    raise
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(f"{case.name} {name}: cannot run: {reason}")
                continue
            if name == "flash":
                baseline = got
            row["flash_diff"] = None if baseline is None else max_abs_diff(got, baseline)
            rows.append(row)
            del got
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<5} {'backend':<7} {'queries':>8} {'key rows':>9} {'fwd ms':>8} {'f+b ms':>8} {'peak GB':>8} "
          f"{'ref err':>8} {'vs flash':>8}  note")
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        diff = "-" if r["flash_diff"] is None else f"{r['flash_diff']:.1e}"
        print(f"{r['case']:<5} {r['backend']:<7} {r['queries']:>8,} {r['key_rows']:>9,} {r['fwd_ms']:>8.2f} "
              f"{r['fwd_bwd_ms']:>8.2f} {peak:>8} {r['ref_err']:>8.1e} {diff:>8}  {r['note']}")


def parse_backends(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CHOICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"backends are a comma-separated subset of {','.join(CHOICES)}, got {text!r}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--token-scale", type=float, default=1.0, help="multiplies every generated length")
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=5, help="timed calls; the median counts")
    parser.add_argument("--backends", type=parse_backends, default=BACKENDS,
                        help=f"comma-separated, of {','.join(CHOICES)} (default: all but reference)")
    parser.add_argument("--model", default="ling-3-tiny", help="preset whose full-attention shapes are timed")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: float32; only the reference runs (a check of the benchmark itself)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    try:
        model_shapes(args.model)
    except (KeyError, ValueError) as e:
        parser.error(f"--model: {e}")
    print_table(run(args, torch.device(args.device)))
    print("command: python -m bench.attention " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
