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

from models.attention_core import AttentionRows
from models.decoder import DecoderLayer, DecoderOutput, HybridForCausalLM
from models.linear_attention import CoreInputs, LinearAttention
from models.logprobs import compact_logprobs
from models.moe import MoEStats
from models.tree.attention import Backend, tree_attention
from models.tree.layout import TreeLayout

__all__ = ["tree_hidden_states", "tree_logprobs", "linear_attention_rounds"]


def _conv_initial_state(x_CX: torch.Tensor, context_NW: torch.Tensor) -> torch.Tensor:
    """fla conv state [N, Cc, W]: slot 0 padding, slots 1..W-1 the context rows oldest first (zeros where -1)."""
    padded = torch.cat([x_CX.new_zeros(1, x_CX.shape[1]), x_CX])
    ctx_NWX = padded[context_NW + 1]
    return torch.cat([x_CX.new_zeros(ctx_NWX.shape[0], 1, x_CX.shape[1]), ctx_NWX], dim=1).transpose(1, 2)


def linear_attention_rounds(mixer: LinearAttention, inputs: CoreInputs, layout: TreeLayout) -> torch.Tensor:
    """Run the core over the plan's rounds; returns o [C, HV, V] in physical order (replay outputs dropped)."""
    state_dtype = torch.float64 if inputs.v.dtype == torch.float64 else torch.float32
    HV, K, V = inputs.v.shape[1], inputs.k.shape[2], inputs.v.shape[2]
    zero = inputs.v.new_zeros(1, HV, K, V, dtype=state_dtype)
    produced: list[torch.Tensor] = []
    outputs = []
    for rd in layout.rounds:
        if rd.all_zero_init:
            h0 = None
        else:
            h0 = torch.cat([zero, *produced])[rd.init_state + 1]
        gathered = CoreInputs(*(t[rd.gather] for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)))
        o, _, states = mixer.core(
            gathered, rd.cu_seqlens, initial_state=h0, state_seq=rd.state_seq, state_chunk=rd.state_chunk
        )
        outputs.append(o[rd.output_pos])
        if states is not None:
            produced.append(states.to(state_dtype))
    return torch.cat(outputs)


def _linear_mixer(mixer: LinearAttention, h_CD: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    rows = mixer.project(h_CD)
    init = _conv_initial_state(rows.qkv, layout.conv_context)
    qkv_CX, _ = mixer.conv(rows.qkv, layout.seq_cu, initial_state=init)
    o = linear_attention_rounds(mixer, mixer.activate(rows, qkv_CX), layout)
    return mixer.output(o, rows)


def _attention_mixer(mixer, h_CD: torch.Tensor, layout: TreeLayout, backend: Backend) -> torch.Tensor:
    rows: AttentionRows = mixer.project(h_CD, layout.positions)
    o = tree_attention(rows.q, rows.k, rows.v, layout.attention, mixer.scale, backend)
    return mixer.output(o, rows)


def _tree_layer(
    layer: DecoderLayer, x_CD: torch.Tensor, layout: TreeLayout, backend: Backend
) -> tuple[torch.Tensor, MoEStats | None]:
    h_CD = layer.input_layernorm(x_CD)
    if layer.layer_type == "full_attention":
        h_CD = _attention_mixer(layer.mixer, h_CD, layout, backend)
    else:
        h_CD = _linear_mixer(layer.mixer, h_CD, layout)
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
