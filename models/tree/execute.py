"""Execute a HybridForCausalLM on the compact rows of a rollout-tree microbatch (HARTS §3.4-3.5).

Legend: C compact rows (physical order of the plan), D model dim, S semantic positions.

The model runs its own layer loop under a `models.tree.mixers.TreeContext` (see `models.decoder`); the tree's row
couplings (ancestor attention, ancestor-context conv, round-wise linear attention) are in `models.tree.mixers`.
Layers with activation checkpointing on (`model.set_activation_checkpointing`, `models.recompute`) recompute their
chosen part in backward from the same layout (nothing is re-planned).
"""

from __future__ import annotations

from models.decoder import DecoderOutput, HybridForCausalLM
from models.tree.attention import Backend
from models.tree.layout import TreeLayout

__all__ = ["tree_hidden_states", "tree_logprobs"]


def tree_hidden_states(
    model: HybridForCausalLM, layout: TreeLayout, attention_backend: Backend = "dense"
) -> DecoderOutput:
    """Final-normed hidden states [C, D] of the physical rows, and per-layer MoE statistics (multiplicity-weighted)."""
    return model.tree_hidden_states(layout, attention_backend)


def tree_logprobs(
    model: HybridForCausalLM, layout: TreeLayout, attention_backend: Backend = "dense", entropy: bool = False,
    chunk_rows: int | None = None,
):
    """Semantic log-probabilities [S] in original order (0 for first tokens), the DecoderOutput, and [S] entropies
    if asked: (logprobs, output) or (logprobs, entropy, output).

    Enters the model through `model(layout, ...)`, so a parallelized model (FSDP2 root unit, vocabulary-parallel
    LM head under tensor parallelism: `parallel.parallelize_hybrid`) runs the same way as a plain one.
    """
    out = model(layout, attention_backend, chunk_rows=chunk_rows, entropy=entropy)
    output = DecoderOutput(out.hidden, out.moe_stats)
    return (out.logprobs, out.entropy, output) if entropy else (out.logprobs, output)
