"""Model FLOPs of a training step, the numerator of MFU: 6 per active parameter and row, and, apart,
full attention's score and value products, which grow with the context a row sees, not with the parameters.

`6 N` per row (forward 2 N, backward 4 N) is the common MFU convention. Attention adds, per causal
query-key pair and full-attention layer, 2 H (d_qk + d_v) FLOPs forward and twice that backward: 6 H (d_qk + d_v).
That is the per-pair form of the `6 l h (d_qk + d_v) t` per token that torchtitan adds to `6 N` (PaLM's `12 l h q t`
with d_qk = d_v = q); they count all t keys of a length-t sequence, where the pairs here are each row against its
ancestors and itself.
Neither term counts recomputation, linear attention's chunk products, norms or routing. MFU is model FLOPs per
second over the dense bf16 peak.
"""

from __future__ import annotations

from models.config import GatedAttentionConfig, MLAConfig, ModelConfig
from models.decoder import HybridForCausalLM

__all__ = ["PEAK_FLOPS", "active_params", "attention_flops_per_pair", "mfu"]

#: Dense bf16 peak of an H100/H200 SXM (datasheet), for MFU.
PEAK_FLOPS = {"cuda": 989e12}


def active_params(model: HybridForCausalLM) -> int:
    """Parameters one token touches: everything but the embedding table, routed experts at top_k / E."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not model.config.tie_word_embeddings:
            continue
        if ".experts." in name:
            total += p.numel() * model.config.moe.top_k // model.config.moe.num_experts
        else:
            total += p.numel()
    return total


def attention_flops_per_pair(config: ModelConfig) -> int:
    """Forward and backward FLOPs of one causal query-key pair, summed over the model's full-attention layers:
    6 H (d_qk + d_v) per layer (scores Q K^T and the value product P V, backward twice the forward)."""
    layers = sum(kind == "full_attention" for kind in config.layer_types)
    if layers == 0:
        return 0
    attention = config.full_attention
    if isinstance(attention, MLAConfig):
        heads, d_qk, d_v = attention.num_heads, attention.qk_head_dim, attention.v_head_dim
    elif isinstance(attention, GatedAttentionConfig):
        heads, d_qk, d_v = attention.num_heads, attention.head_dim, attention.head_dim
    else:
        raise TypeError(f"no attention FLOPs for {type(attention).__name__}")
    return 6 * heads * (d_qk + d_v) * layers


def mfu(params: int, rows: float, attention_per_pair: int, pairs: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation of `rows` rows and `pairs` causal query-key pairs trained in `seconds`:
    (6 params rows + attention_per_pair pairs) / seconds / peak. Pass `attention_per_pair = 0` for the `6 N` form."""
    return (6 * params * rows + attention_per_pair * pairs) / seconds / peak
