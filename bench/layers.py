"""Per-layer GPU check: fast path (fla kernels, varlen flash attention, grouped-GEMM experts, fused row-wise ops)
against the plain-torch reference path, forward and backward, on one layer of each kind of a preset, in bf16.

    python -m bench.layers [--preset ling-3-tiny] [--tokens 8192] [--seq-len 2048] [--kinds kda mla dense moe]
                           [--iters 5] [--out FILE.md]

Each kind runs one decoder component at the preset's sizes on `--tokens` packed rows (sequences of `--seq-len`):
`kda`/`gdn`/`mla`/`gated` the token mixer, `dense`/`moe` the FFN. Inputs and parameters are bf16. The reference path
swaps the dispatchers for the plain-torch ops (naive chunkwise delta rule, naive conv and gated norm, dense-mask
softmax attention, per-expert loop) and runs the row-wise references (norms, SwiGLU and gates, the KDA decay gate,
the MoE combine: the model's `KernelSettings.fused_rowwise` off); both paths see the same inputs and weights. Errors
are relative Frobenius norms of the fast result against the reference one: output, input gradient, and the worst
parameter gradient.
Times are medians over `--iters` after two warm-ups (the first fla call compiles and autotunes for minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import sys
import time

import torch

import models
import models.attention_core as attention_core
import models.gated_attention
import models.gdn
import models.kda
import models.linear_attention
import models.mla
import models.moe
import models.norms
from models.config import GatedAttentionConfig, GDNConfig
from models.decoder import DecoderLayer, flat_context
from models.experts import naive_expert_swiglu
from models.ops.conv import naive_causal_conv1d
from models.ops.gdn import naive_chunk_gdn
from models.ops.kda import naive_chunk_kda
from models.ops.norm import naive_rms_norm_gated
from models.ops.settings import KernelSettings

KINDS = ("kda", "gdn", "mla", "gated", "dense", "moe")


def _reference_attention(q, k, v, mask, scale, pair):
    return attention_core.naive_attention(q, k, v, mask.dense(), scale)


def _reference_expert_swiglu(x_MD, gate_up_E2FD, down_EDF, counts_E, fused):
    return naive_expert_swiglu(x_MD, gate_up_E2FD, down_EDF, counts_E)


@contextlib.contextmanager
def reference_ops(model: models.HybridForCausalLM):
    """Route every op of `model` to its plain-torch reference (the dispatchers pick the fast path on CUDA; the
    row-wise ones unless the model's kernel settings turn them off)."""
    kernels = model.kernels
    patches = [
        (models.kda.KimiDeltaAttention, "core_op", staticmethod(naive_chunk_kda)),
        (models.gdn.GatedDeltaNet, "core_op", staticmethod(naive_chunk_gdn)),
        (models.linear_attention, "short_conv", naive_causal_conv1d),
        (models.norms, "gated_rms_norm", naive_rms_norm_gated),
        (models.gated_attention, "attention", _reference_attention),
        (models.mla, "attention", _reference_attention),
        (models.moe, "expert_swiglu", _reference_expert_swiglu),
    ]
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        model.use_kernels(dataclasses.replace(kernels, fused_rowwise=False))
        yield
    finally:
        model.use_kernels(kernels)
        for obj, name, value in saved:
            setattr(obj, name, value)


def layer_config(preset: str, kind: str) -> models.ModelConfig:
    """The preset, with the mixer of `kind` swapped in at matching sizes when the preset has another one."""
    config = models.preset(preset)
    D = config.hidden_size
    heads = getattr(config.full_attention, "num_heads", 16)
    if kind == "gdn" and not isinstance(config.linear_attention, GDNConfig):
        config.linear_attention = GDNConfig(num_k_heads=heads, num_v_heads=heads, head_k_dim=128, head_v_dim=128)
    if kind == "gated" and not isinstance(config.full_attention, GatedAttentionConfig):
        config.full_attention = GatedAttentionConfig(num_heads=heads, num_kv_heads=max(1, heads // 8),
                                                     head_dim=D // heads)
    return dataclasses.replace(config, dtype="bfloat16")


def build(preset: str, kind: str, device,
          kernels: KernelSettings) -> tuple[models.HybridForCausalLM, DecoderLayer, str]:
    config = layer_config(preset, kind)
    layer_type = "linear_attention" if kind in ("kda", "gdn") else "full_attention"
    ffn_type = "moe" if kind == "moe" else "dense"
    config = dataclasses.replace(config, layer_types=(layer_type,), ffn_types=(ffn_type,))
    torch.manual_seed(0)
    model = models.HybridForCausalLM(config, kernels)
    layer: DecoderLayer = model.model.layers[0].to(device)
    part = "mlp" if kind in ("dense", "moe") else "mixer"
    return model, layer, part


def run_once(layer: DecoderLayer, part: str, x: torch.Tensor, ctx, grad_out: torch.Tensor):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    if part == "mlp":
        y = layer.mlp(x)
        y = y[0] if isinstance(y, tuple) else y
    elif layer.layer_type == "full_attention":
        y = layer.mixer(x, ctx.position_ids, ctx.mask)
    else:
        y = layer.mixer(x, ctx.cu_seqlens)
    y.backward(grad_out)
    grads = {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach().float(), x.grad.float(), grads


@torch.no_grad()
def run_fwd(layer, part, x, ctx):
    if part == "mlp":
        return layer.mlp(x)
    if layer.layer_type == "full_attention":
        return layer.mixer(x, ctx.position_ids, ctx.mask)
    return layer.mixer(x, ctx.cu_seqlens)


def timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_kind(args, kind: str, device, kernels: KernelSettings) -> dict:
    model, layer, part = build(args.preset, kind, device, kernels)
    T = args.tokens
    lengths = [args.seq_len] * (T // args.seq_len) + ([T % args.seq_len] if T % args.seq_len else [])
    cu = torch.tensor([0, *lengths], device=device).cumsum(0)
    ctx = flat_context(T, None, cu, device)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, layer.input_layernorm.weight.shape[0], device=device, generator=g).bfloat16()
    grad_out = torch.randn(x.shape, device=device, generator=g).bfloat16()

    fast = run_once(layer, part, x, ctx, grad_out)
    with reference_ops(model):
        ref = run_once(layer, part, x, ctx, grad_out)
    worst = max(ref[2], key=lambda n: rel(fast[2][n], ref[2][n]))
    row = {
        "kind": kind,
        "out": rel(fast[0], ref[0]),
        "dx": rel(fast[1], ref[1]),
        "worst dparam": f"{rel(fast[2][worst], ref[2][worst]):.1e} ({worst})",
    }
    fwd = functools.partial(run_fwd, layer, part, x, ctx)
    both = functools.partial(run_once, layer, part, x, ctx, grad_out)
    row["fast fwd ms"] = 1e3 * timed(fwd, args.iters)
    row["fast fwd+bwd ms"] = 1e3 * timed(both, args.iters)
    with reference_ops(model):
        row["ref fwd ms"] = 1e3 * timed(fwd, max(1, args.iters // 2))
        row["ref fwd+bwd ms"] = 1e3 * timed(both, max(1, args.iters // 2))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ling-3-tiny", choices=sorted(models.PRESETS))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--kinds", nargs="+", default=["kda", "mla", "dense", "moe"], choices=KINDS)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--reference-rowwise", action="store_true",
                        help="the fast pass runs the row-wise references, not their fused kernels "
                             "(train.fused_rowwise = false)")
    args = parser.parse_args(argv)
    kernels = KernelSettings(fused_rowwise=not args.reference_rowwise)
    if not torch.cuda.is_available():
        print("bench.layers needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"preset={args.preset} tokens={args.tokens} seq_len={args.seq_len} dtype=bf16 iters={args.iters} "
          f"torch={torch.__version__} device={torch.cuda.get_device_name()}", flush=True)
    rows = []
    for kind in args.kinds:
        try:
            rows.append(bench_kind(args, kind, device, kernels))
        # One failing kernel (e.g. fla's GDN backward on Hopper with triton < 3.7.1) should not hide the other rows.
        except Exception as error:
            rows.append({"kind": kind, "out": f"error: {type(error).__name__}: {str(error)[:120]}"})
        print(rows[-1], flush=True)
    columns = ["kind", "out", "dx", "worst dparam", "fast fwd ms", "fast fwd+bwd ms", "ref fwd ms", "ref fwd+bwd ms"]
    def fmt(column: str, value) -> str:
        if isinstance(value, float):
            return f"{value:.2f}" if column.endswith("ms") else f"{value:.1e}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(c, r.get(c, "")) for c in columns) + " |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
