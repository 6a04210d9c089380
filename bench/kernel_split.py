"""Where a profiled run's device time goes, by kind of kernel: GEMM, grouped GEMM (the experts), attention, KDA
(fla's chunked recurrence kernels and the tree's chains), row-wise (norms, activations, element-wise, gathers, copies)
and idle (the unprofiled wall time the kernels do not fill: launches, host preparation, synchronisations).

Kernels are sorted by their names, which the libraries choose (cuBLAS `nvjet_*`/`sm90_xmma_*`, CUTLASS grouped GEMMs,
FlashAttention `flash_*`, fla's `chunk_*`): `KINDS` lists the patterns in the order they are tried; the printed top
kernels of each kind let a reader check the sorting.
"""

from __future__ import annotations

import re
from collections import defaultdict

from bench.ceiling import is_device_work

__all__ = ["KINDS", "kernel_kind", "kernel_split", "describe_split"]

#: (kind, name pattern), tried in order; a kernel matching none is row-wise.
KINDS = (
    ("grouped GEMM", re.compile(r"grouped|GroupProblem|_grouped_mm", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention", re.I)),
    ("KDA", re.compile(r"kda|delta_rule|recompute_w_u|chunk_|_chain|wy_|fwd_h|bwd_dh|conv1d", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|sm90_|sm80_", re.I)),
)
ROWWISE = "row-wise"


def kernel_kind(name: str) -> str:
    """The kind of a device kernel or copy by its name."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), ROWWISE)


def kernel_split(prof, wall_s: float) -> dict[str, tuple[float, list[tuple[str, float]]]]:
    """{kind: (seconds, its three kernels with the most time)} of a `torch.profiler` profile, plus "idle": `wall_s`
    (an unprofiled run's wall time) less all device time (one stream: kernels do not overlap)."""
    seconds: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for e in prof.key_averages():
        if is_device_work(e) and e.self_device_time_total > 0:
            kind, s = kernel_kind(e.key), e.self_device_time_total / 1e6
            seconds[kind] += s
            kernels[kind].append((e.key, s))
    split = {kind: (seconds[kind], sorted(kernels[kind], key=lambda k: -k[1])[:3])
             for kind in [k for k, _ in KINDS] + [ROWWISE]}
    split["idle"] = (max(0.0, wall_s - sum(seconds.values())), [])
    return split


def describe_split(split: dict[str, tuple[float, list[tuple[str, float]]]]) -> str:
    """One line of shares, then each kind's top kernels."""
    total = sum(s for s, _ in split.values()) or 1.0
    lines = ["kernel split of the wall time: " + ", ".join(
        f"{kind} {s:.3f} s ({s / total:.0%})" for kind, (s, _) in split.items())]
    for kind, (_, top) in split.items():
        if top:
            lines.append(f"  {kind}: " + "; ".join(f"{name[:70]} {s:.3f} s" for name, s in top))
    return "\n".join(lines)
