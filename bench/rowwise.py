"""Row-wise op timings on the GPU: each fused path against its plain-torch reference, forward and forward+backward,
at one microbatch's rows and the widths of a preset, in bf16.

    python -m bench.rowwise --device cuda [--preset ling-3-tiny] [--rows 60000] [--iters 20]

Ops (widths from the preset): `rms_norm` over the model dim (the decoder's pre-norms and final norm), the same with
the mixer's residual add fused (`rms_norm+residual`), over the MLA kv latent (`rms_norm latent`, MLA presets) or a
head (`rms_norm head`, gated-attention presets: q/k norm); `swiglu` of the dense FFN, of the routed experts (rows x
top-k pairs, the two halves of the gate|up product read in place) and of the shared expert; `sigmoid_gate` of the
gated attention output (gated-attention presets); `kda_decay`, KDA's per-channel decay gate (KDA presets); `l2_norm`,
the linear-attention q/k norm on the k heads of a q|k|v conv output (read in place); `moe_combine`, the weighted
sum of each row's top-k expert rows (MoE presets). Each row: the reference and fused times in ms (medians over
`--iters` after two warm-ups, `bench.layers.timed`), their ratio reference / fused, and the fused path's relative
error against the reference. Backward runs from a fixed random output gradient.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

import models
from bench.layers import rel, timed
from models.config import GatedAttentionConfig, KDAConfig, MLAConfig
from models.ops.combine import naive_moe_combine
from models.ops.gate import fused_kda_decay, naive_kda_decay
from models.ops.glu import fused_sigmoid_gate, fused_swiglu, naive_sigmoid_gate, naive_swiglu
from models.ops.l2norm import naive_l2_norm
from models.ops.rmsnorm import naive_rms_norm


def norm(impl: Callable, eps: float, zero_centered: bool, residual: bool) -> Callable:
    if residual:
        return lambda x, w, r: impl(x, w, eps, zero_centered, r)[0]
    return lambda x, w: impl(x, w, eps, zero_centered)[0]


def glu_halves(impl: Callable) -> Callable:
    return lambda both: impl(*both.chunk(2, dim=-1))


def cases(config: models.ModelConfig, rows: int) -> list[tuple[str, Callable, Callable, list[torch.Tensor]]]:
    """(name, reference, fused, bf16 CUDA inputs) for the preset's row-wise ops."""
    from models.ops.combine.fused import fused_moe_combine
    from models.ops.l2norm.fused import fused_l2_norm
    from models.ops.rmsnorm.fused import fused_rms_norm

    D, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered_norm
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).bfloat16()

    def weight(n):
        return randn(n, scale=0.1) + (0 if zc else 1)

    out = [
        ("rms_norm", norm(naive_rms_norm, eps, zc, False), norm(fused_rms_norm, eps, zc, False),
         [randn(rows, D), weight(D)]),
        ("rms_norm+residual", norm(naive_rms_norm, eps, zc, True), norm(fused_rms_norm, eps, zc, True),
         [randn(rows, D), weight(D), randn(rows, D)]),
    ]
    attention = config.full_attention
    if isinstance(attention, MLAConfig):
        R = attention.kv_lora_rank
        out.append(("rms_norm latent", norm(naive_rms_norm, attention.latent_norm_eps, zc, False),
                    norm(fused_rms_norm, attention.latent_norm_eps, zc, False), [randn(rows, R), weight(R)]))
    if isinstance(attention, GatedAttentionConfig):
        H, K = attention.num_heads, attention.head_dim
        out.append(("rms_norm head", norm(naive_rms_norm, eps, zc, False), norm(fused_rms_norm, eps, zc, False),
                    [randn(rows, H, K), weight(K)]))
        out.append(("sigmoid_gate", naive_sigmoid_gate, fused_sigmoid_gate, [randn(rows, H * K), randn(rows, H * K)]))
    linear = config.linear_attention
    if isinstance(linear, KDAConfig):
        H, K = linear.num_heads, linear.head_dim
        A_log = (torch.rand(1, 1, H, 1, generator=g, device="cuda") * 2.7).bfloat16()
        out.append(("kda_decay", naive_kda_decay, fused_kda_decay, [randn(rows, H, K), A_log, randn(H * K)]))
    if linear is not None:
        H, K = (linear.num_heads, linear.head_dim) if isinstance(linear, KDAConfig) else (
            linear.num_k_heads, linear.head_k_dim)
        V = linear.num_heads * linear.head_dim if isinstance(linear, KDAConfig) else (
            linear.num_v_heads * linear.head_v_dim)

        def k_heads(impl):
            return lambda qkv: impl(qkv[:, H * K : 2 * H * K].view(-1, H, K))

        out.append(("l2_norm", k_heads(naive_l2_norm), k_heads(fused_l2_norm), [randn(rows, 2 * H * K + V)]))
    if "dense" in config.ffn_types:
        F_ = config.dense_ffn.intermediate_size
        out.append(("swiglu dense", glu_halves(naive_swiglu), glu_halves(fused_swiglu), [randn(rows, 2 * F_)]))
    if config.moe is not None:
        m = config.moe
        out.append(("swiglu experts", glu_halves(naive_swiglu), glu_halves(fused_swiglu),
                    [randn(rows * m.top_k, 2 * m.expert_intermediate_size)]))
        if m.shared_expert_intermediate_size:
            S = m.shared_expert_intermediate_size
            out.append(("swiglu shared", glu_halves(naive_swiglu), glu_halves(fused_swiglu), [randn(rows, 2 * S)]))
        slot = torch.randperm(rows * m.top_k, generator=g, device="cuda").view(rows, m.top_k)

        def combine(impl):
            return lambda y, w: impl(y, slot, w)

        out.append(("moe_combine", combine(naive_moe_combine), combine(fused_moe_combine),
                    [randn(rows * m.top_k, D), torch.rand(rows, m.top_k, generator=g, device="cuda")]))
    return out


def fwd_bwd(op: Callable, inputs: list[torch.Tensor], dy: torch.Tensor) -> Callable[[], None]:
    def run():
        leaves = [t.requires_grad_(True) for t in inputs]
        torch.autograd.grad(op(*leaves), leaves, dy)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda"])
    parser.add_argument("--preset", default="ling-3-tiny", choices=sorted(models.PRESETS))
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench.rowwise needs a CUDA device (--device cuda)", file=sys.stderr)
        return 2
    print("python -m bench.rowwise " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"preset={args.preset} rows={args.rows} dtype=bf16 iters={args.iters} torch={torch.__version__} "
          f"device={torch.cuda.get_device_name()}", flush=True)
    header = ("op", "shape", "ref fwd ms", "fused fwd ms", "fwd x", "ref fwd+bwd ms", "fused fwd+bwd ms", "fwd+bwd x",
              "rel err")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, reference, fused, inputs in cases(models.preset(args.preset), args.rows):
        with torch.no_grad():
            y_ref, y = reference(*inputs), fused(*inputs)
        dy = torch.randn_like(y_ref)
        ref_fwd = timed(lambda: reference(*inputs), args.iters)
        fused_fwd = timed(lambda: fused(*inputs), args.iters)
        ref_all = timed(fwd_bwd(reference, inputs, dy), args.iters)
        fused_all = timed(fwd_bwd(fused, inputs, dy), args.iters)
        for t in inputs:
            t.requires_grad_(False)
        cells = (name, "x".join(map(str, inputs[0].shape)), f"{1e3 * ref_fwd:.3f}", f"{1e3 * fused_fwd:.3f}",
                 f"{ref_fwd / fused_fwd:.2f}", f"{1e3 * ref_all:.3f}", f"{1e3 * fused_all:.3f}",
                 f"{ref_all / fused_all:.2f}", f"{rel(y.float(), y_ref.float()):.1e}")
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
