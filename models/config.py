"""Typed configuration of the hybrid decoder: one dataclass per component, validated once at construction.

A model is a stack of layers; layer i has a token mixer `layer_types[i]` ("full_attention" or "linear_attention")
and a feed-forward `ffn_types[i]` ("dense" or "moe"). Which full attention (gated GQA or MLA) and which linear
attention (GDN or KDA) the model uses is given by the type of `full_attention` / `linear_attention`.
`family` fixes the Hugging Face naming (module attribute names, checkpoint keys, config.json layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerType = Literal["full_attention", "linear_attention"]
FFNType = Literal["dense", "moe"]
Family = Literal["qwen3_next", "kimi_linear"]

FAMILIES = ("qwen3_next", "kimi_linear")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"`{owner}.{name}` must be positive, got {value}")


@dataclass(kw_only=True)
class GatedAttentionConfig:
    """Qwen3-Next full attention: GQA with a sigmoid output gate, zero-centred q/k RMSNorm and partial RoPE."""

    num_heads: int
    """Query heads H."""
    num_kv_heads: int
    """Key/value heads; must divide `num_heads` (GQA)."""
    head_dim: int
    """Head dimension of queries, keys and values."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's leading dimensions that RoPE rotates (Qwen3-Next: 0.25)."""

    def __post_init__(self) -> None:
        _positive("GatedAttentionConfig", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                  head_dim=self.head_dim, rope_theta=self.rope_theta)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"`num_kv_heads` ({self.num_kv_heads}) must divide `num_heads` ({self.num_heads})")
        if self.rotary_dim % 2 or not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"`partial_rotary_factor` ({self.partial_rotary_factor}) must lie in (0, 1] and give an even "
                f"rotary dimension of `head_dim` ({self.head_dim}), got {self.rotary_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_shape(self) -> tuple[int, int, bool]:
        """(query/key head dim, value head dim, whether key/value heads are shared by several query heads): what
        the packed attention kernels see (`models.ops.varlen_attention.auto_cuda_attention`)."""
        return self.head_dim, self.head_dim, self.num_kv_heads < self.num_heads


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention as in Kimi-Linear (DeepSeek-V2 MLA; Kimi-Linear runs it without RoPE)."""

    num_heads: int
    """Attention heads H (keys and values are decompressed per head)."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (RMS-normed before decompression)."""
    q_lora_rank: int | None = None
    """Width of the compressed query latent; None = full-rank `q_proj` (Kimi-Linear)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimensions decompressed from the latent."""
    qk_rope_head_dim: int = 64
    """Per-head query dimensions matched against the one key part shared by all heads (rotated if `rope`)."""
    v_head_dim: int = 128
    """Per-head value dimension."""
    rope: bool = False
    """Rotate the shared part with RoPE (DeepSeek); False = NoPE, as Kimi-Linear."""
    rope_theta: float = 10_000.0
    """RoPE base when `rope` is on."""
    latent_norm_eps: float = 1e-6
    """Epsilon of the q/kv latent RMSNorms. transformers' KimiLinearAttention uses the RMSNorm default 1e-6, not
    `rms_norm_eps`; vLLM's Kimi-Linear uses `rms_norm_eps` (1e-5), a small train/serve mismatch."""

    def __post_init__(self) -> None:
        _positive("MLAConfig", latent_norm_eps=self.latent_norm_eps, num_heads=self.num_heads,
                  kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                  qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rope_theta=self.rope_theta)
        if self.q_lora_rank is not None:
            _positive("MLAConfig", q_lora_rank=self.q_lora_rank)
        if self.rope and self.qk_rope_head_dim % 2:
            raise ValueError(f"`qk_rope_head_dim` must be even with `rope=True`, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_shape(self) -> tuple[int, int, bool]:
        """(query/key head dim, value head dim, False: every head has its own decompressed keys and values), as
        `GatedAttentionConfig.attention_shape`."""
        return self.qk_head_dim, self.v_head_dim, False


@dataclass(kw_only=True)
class GDNConfig:
    """Gated DeltaNet as in Qwen3-Next: fused q|k|v|z and b|a projections, one log decay per value head and token."""

    num_k_heads: int
    """Query/key heads H."""
    num_v_heads: int
    """Value heads HV, a multiple of H (value head j reads query/key head j // (HV // H))."""
    head_k_dim: int
    """Query/key head dimension K."""
    head_v_dim: int
    """Value head dimension V."""
    conv_size: int = 4
    """Width W of the causal depthwise conv over q|k|v."""
    chunk_size: int = 64
    """Chunk length B of the chunkwise core (fla GDN kernels accept 16, 32, 64)."""

    def __post_init__(self) -> None:
        _positive("GDNConfig", num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                  head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim, conv_size=self.conv_size)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"`num_v_heads` ({self.num_v_heads}) must be a multiple of `num_k_heads` ({self.num_k_heads})"
            )
        if self.chunk_size not in (16, 32, 64):
            raise ValueError(f"`chunk_size` must be 16, 32 or 64 for GDN, got {self.chunk_size}")


@dataclass(kw_only=True)
class KDAConfig:
    """Kimi Delta Attention as in Kimi-Linear: per-channel log decay from a low-rank forget gate."""

    num_heads: int
    """Heads H (queries, keys and values have the same number of heads)."""
    head_dim: int
    """Head dimension K = V."""
    conv_size: int = 4
    """Width W of the causal depthwise conv over q|k|v."""
    chunk_size: int = 64
    """Chunk length B of the chunkwise core (fla KDA kernels accept 32 and 64)."""

    def __post_init__(self) -> None:
        _positive("KDAConfig", num_heads=self.num_heads, head_dim=self.head_dim, conv_size=self.conv_size)
        if self.chunk_size not in (32, 64):
            raise ValueError(f"`chunk_size` must be 32 or 64 for KDA, got {self.chunk_size}")


@dataclass(kw_only=True)
class DenseFFNConfig:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    intermediate_size: int
    """Hidden width F."""

    def __post_init__(self) -> None:
        _positive("DenseFFNConfig", intermediate_size=self.intermediate_size)


@dataclass(kw_only=True)
class MoEConfig:
    """Top-k routed SwiGLU experts plus an optional shared expert (see `models.moe` for the exact formulas)."""

    num_experts: int
    """Routed experts E."""
    top_k: int
    """Experts per token."""
    expert_intermediate_size: int
    """Hidden width F of each routed expert."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Qwen3-Next) or per-expert sigmoid (Kimi-Linear, DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the k selected scores to sum to 1."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routed weights after renormalisation (Kimi-Linear: 2.446)."""
    num_groups: int = 1
    """Expert groups for group-limited routing (a token picks `topk_groups` groups, then k experts inside them)."""
    topk_groups: int = 1
    """Groups a token may route to."""
    expert_bias: bool = False
    """Auxiliary-loss-free balancing: a per-expert bias (buffer `e_score_correction_bias`) added to the scores
    for the choice of experts only, updated outside the optimiser from the load counts."""
    shared_expert_intermediate_size: int = 0
    """Hidden width of the shared SwiGLU expert every token passes through; 0 = none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(w . x) (Qwen3-Next)."""

    def __post_init__(self) -> None:
        _positive("MoEConfig", num_experts=self.num_experts, top_k=self.top_k,
                  expert_intermediate_size=self.expert_intermediate_size, num_groups=self.num_groups,
                  topk_groups=self.topk_groups, routed_scaling_factor=self.routed_scaling_factor)
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"`score_func` must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(
                f"`num_groups` ({self.num_groups}) must divide `num_experts` ({self.num_experts}) and be >= "
                f"`topk_groups` ({self.topk_groups})"
            )
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"`top_k` ({self.top_k}) exceeds the experts reachable in `topk_groups` ({self.topk_groups}) groups"
            )
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("group-limited routing scores each group by its top-2 experts: use >= 2 experts per group")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"`shared_expert_intermediate_size` must be >= 0, got {self.shared_expert_intermediate_size}"
            )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("`shared_expert_gate` needs a shared expert: set `shared_expert_intermediate_size`")


@dataclass(kw_only=True)
class ModelConfig:
    """The whole decoder: embeddings -> layers (mixer + FFN, pre-norm residual) -> final RMSNorm -> LM head."""

    family: Family
    """Hugging Face family whose names and checkpoint layout the model uses: "qwen3_next" (Qwen3NextForCausalLM) or
    "kimi_linear" (KimiLinearForCausalLM). It fixes names only; the components are free."""
    vocab_size: int
    """Vocabulary size of embeddings and LM head."""
    hidden_size: int
    """Model width D."""
    layer_types: tuple[LayerType, ...]
    """Token mixer of each layer; its length is the number of layers."""
    ffn_types: tuple[FFNType, ...]
    """Feed-forward of each layer."""
    full_attention: GatedAttentionConfig | MLAConfig | None = None
    """Mixer of the "full_attention" layers."""
    linear_attention: GDNConfig | KDAConfig | None = None
    """Mixer of the "linear_attention" layers."""
    dense_ffn: DenseFFNConfig | None = None
    """FFN of the "dense" layers."""
    moe: MoEConfig | None = None
    """FFN of the "moe" layers."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (layer norms, q/k norms, latent norms, gated output norms)."""
    zero_centered_norm: bool = False
    """RMSNorm scales by (1 + w) with w initialised to 0 (Qwen3-Next) instead of w initialised to 1 (Kimi-Linear).
    Applies to the layer, final, q/k and latent norms; the gated output norm of linear attention always uses w."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """Parameter dtype."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of projection and embedding weights."""
    max_position_embeddings: int = 32768
    """Longest context the checkpoint claims (written to config.json; not enforced)."""
    bos_token_id: int | None = None
    """Written to config.json."""
    eos_token_id: int | list[int] | None = None
    """Written to config.json."""
    pad_token_id: int | None = None
    """Written to config.json."""

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types)
        self.ffn_types = tuple(self.ffn_types)
        if self.family not in FAMILIES:
            raise ValueError(f"`family` must be one of {FAMILIES}, got {self.family!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"`dtype` must be one of {DTYPES}, got {self.dtype!r}")
        _positive("ModelConfig", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  rms_norm_eps=self.rms_norm_eps)
        if not self.layer_types or len(self.layer_types) != len(self.ffn_types):
            raise ValueError(
                f"`layer_types` ({len(self.layer_types)}) and `ffn_types` ({len(self.ffn_types)}) must be non-empty "
                "and of equal length (one entry per layer)"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in ("full_attention", "linear_attention"):
                raise ValueError(f"`layer_types[{i}]` must be 'full_attention' or 'linear_attention', got {kind!r}")
        for i, kind in enumerate(self.ffn_types):
            if kind not in ("dense", "moe"):
                raise ValueError(f"`ffn_types[{i}]` must be 'dense' or 'moe', got {kind!r}")
        needs = {
            "full_attention": "full_attention" in self.layer_types,
            "linear_attention": "linear_attention" in self.layer_types,
            "dense_ffn": "dense" in self.ffn_types,
            "moe": "moe" in self.ffn_types,
        }
        for name, needed in needs.items():
            if needed and getattr(self, name) is None:
                raise ValueError(f"`{name}` must be set: some layer uses it")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def chunk_size(self) -> int:
        """Chunk size B of the linear-attention layers, the chunk geometry of tree plans; a model without linear
        attention still plans with fla's usual 64 (it changes nothing there)."""
        return self.linear_attention.chunk_size if self.linear_attention is not None else 64

    @property
    def conv_size(self) -> int:
        """Short-conv width W of the linear-attention layers (1: no conv context to carry)."""
        return self.linear_attention.conv_size if self.linear_attention is not None else 1

    @property
    def attention_shapes(self) -> frozenset[tuple[int, int, bool]]:
        """The `attention_shape` of the full-attention layers (empty: none uses the packed attention kernels)."""
        uses = self.full_attention is not None and "full_attention" in self.layer_types
        return frozenset({self.full_attention.attention_shape}) if uses else frozenset()
