"""Step metrics across data-parallel replicas.

`reduce_step` sums every replica's `StepMetrics` over the DP group (tp ranks of a replica hold the same numbers and
are not counted twice) into the scalars of the whole step; `global_expert_counts` sums the expert loads. The job logs
them with app.metrics (TensorBoard). torchtitan's `MetricsProcessor` is not used: it builds a CUDA
`DeviceMemoryMonitor` at construction (fails on CPU ranks) and reports MFU from a dense-LM flops-per-token that
compact tree rows do not follow.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.runner import StepMetrics

__all__ = ["reduce_step", "global_expert_counts"]


def reduce_step(metrics: StepMetrics, dp_group: dist.ProcessGroup | None, device=None) -> dict[str, float]:
    """Whole-step scalars: loss (sum of microbatch losses = the step loss), microbatches, semantic tokens, compact
    rows, compression (semantic / compact), linear-attention calls, microbatches run flat, and every loss metric
    (summed)."""
    names = ["loss", "microbatches", "semantic_tokens", "compact_rows", "linear_attention_calls",
             "flat_microbatches", *metrics.extras]
    values = [metrics.loss, metrics.microbatches, metrics.semantic_tokens, metrics.compact_rows,
              metrics.linear_attention_calls, metrics.flat_microbatches, *metrics.extras.values()]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(t, group=dp_group)
    out = dict(zip(names, t.tolist()))
    out["compression"] = out["semantic_tokens"] / max(out["compact_rows"], 1.0)
    return out


def global_expert_counts(metrics: StepMetrics, dp_group: dist.ProcessGroup | None) -> list[torch.Tensor | None]:
    """Per MoE layer, the step's multiplicity-weighted expert loads `[E]` summed over replicas (one all-reduce):
    what `models.moe.Router.update_expert_bias` takes after the optimizer step. None for dense layers."""
    counts = [c for c in metrics.expert_counts if c is not None]
    if dp_group is not None and counts:
        stacked = torch.stack(counts)
        dist.all_reduce(stacked, group=dp_group)
        counts = list(stacked.unbind(0))
    it = iter(counts)
    return [None if c is None else next(it) for c in metrics.expert_counts]

