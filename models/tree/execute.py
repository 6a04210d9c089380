"""Execute a HybridForCausalLM on the compact rows of a rollout-tree microbatch (HARTS §3.4-3.5).

Legend: C compact rows (physical order of the plan), D model dim, Cc conv channels, N input sequences, W conv width,
HV value heads, K/V head dims, S semantic positions.

Every row-wise step (embeddings, norms, projections, activations, output projections, MLP/MoE, LM head) runs once
per compact row. What couples rows follows the tree:
- full attention: a row sees its path ancestors and itself (`models.tree.attention`), RoPE at original positions;
- the short conv: each input sequence starts from the W-1 rows preceding it on its own path (never a packing
  neighbour), gathered as the conv's initial state;
- the linear-attention core: one packed call per round of the plan; side branches start from chunk-boundary states
  requested from earlier rounds and replay [floor(p/B)*B, p) of already-activated ancestor rows (state updates only);
  the states are tensors in the graph, so every consumer's gradient reaches their producer;
- MoE statistics are weighted by the rows' multiplicities.
Activation recomputation re-runs the same layout (nothing is re-planned).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from models.decoder import DecoderLayer, DecoderOutput, HybridForCausalLM
from models.logprobs import compact_logprobs
from models.moe import MoEStats
from models.tree.attention import Backend
from models.tree.layout import TreeLayout
from models.tree.mixers import tree_attention_mixer, tree_linear_mixer

__all__ = ["tree_hidden_states", "tree_logprobs"]


def _tree_layer(
    layer: DecoderLayer, x_CD: torch.Tensor, layout: TreeLayout, backend: Backend
) -> tuple[torch.Tensor, MoEStats | None]:
    h_CD = layer.input_layernorm(x_CD)
    if layer.layer_type == "full_attention":
        h_CD = tree_attention_mixer(layer.mixer, h_CD, layout, backend)
    else:
        h_CD = tree_linear_mixer(layer.mixer, h_CD, layout)
    x_CD = x_CD + h_CD
    h_CD = layer.post_attention_layernorm(x_CD)
    if layer.ffn_type == "moe":
        h_CD, stats = layer.mlp(h_CD, layout.row_weight.to(h_CD.dtype))
    else:
        h_CD, stats = layer.mlp(h_CD), None
    return x_CD + h_CD, stats


def tree_hidden_states(
    model: HybridForCausalLM, layout: TreeLayout, attention_backend: Backend = "dense"
) -> DecoderOutput:
    """Final-normed hidden states [C, D] of the physical rows, and per-layer MoE statistics (multiplicity-weighted).

    Layers with activation checkpointing on (`model.set_activation_checkpointing`) are recomputed in backward from
    the same `layout`.
    """
    linear = model.config.linear_attention
    if linear is not None and linear.chunk_size != layout.chunk_size:
        raise ValueError(
            f"the plan was made with chunk_size {layout.chunk_size} but the model's linear attention uses "
            f"{linear.chunk_size}: plan with planner.calls.plan_calls(batch, chunk_size={linear.chunk_size})"
        )
    x_CD = model.model.embed_tokens(layout.tokens)
    stats: list[MoEStats | None] = []
    for layer in model.model.layers:
        if layer.checkpoint_activations and torch.is_grad_enabled():
            x_CD, s = checkpoint(_tree_layer, layer, x_CD, layout, attention_backend, use_reentrant=False)
        else:
            x_CD, s = _tree_layer(layer, x_CD, layout, attention_backend)
        stats.append(s)
    return DecoderOutput(model.model.norm(x_CD), stats)


def tree_logprobs(
    model: HybridForCausalLM, layout: TreeLayout, attention_backend: Backend = "dense", entropy: bool = False,
    chunk_rows: int | None = None,
):
    """Semantic log-probabilities [S] in original order (0 for first tokens), the DecoderOutput, and [S] entropies
    if asked: (logprobs, output) or (logprobs, entropy, output)."""
    out = tree_hidden_states(model, layout, attention_backend)
    result = compact_logprobs(
        out.hidden, model.lm_head_weight, layout.logit_row, layout.target, chunk_rows=chunk_rows, entropy=entropy
    )
    return (*result, out) if entropy else (result, out)
