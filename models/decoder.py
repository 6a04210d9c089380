"""The hybrid decoder: embeddings -> layers (pre-norm mixer + pre-norm FFN, residual) -> final norm -> LM head.

Legend: T tokens (packed rows), B batch rows, N packed sequences, D model dim, V vocabulary.

Module tree and parameter names are those of transformers 5's Qwen3NextForCausalLM / KimiLinearForCausalLM
(`model.embed_tokens`, `model.layers.{i}.input_layernorm`, `.self_attn` or `.linear_attn`, `.post_attention_layernorm`,
`.mlp`, `model.norm`, `lm_head`), so `state_dict()` lines up with `transformers`' `state_dict()` one to one.
`models.hf_io` converts to the on-disk checkpoint layout (per-expert tensors, split convs, ...).

Flat packed forward (`flat_forward`, `hidden_states`): rows of N sequences are concatenated; `cu_seqlens` `[N+1]`
marks the sequences; positions restart at 0 in each sequence unless given; full attention is causal inside each
sequence; linear attention and the short conv restart from zero states at every sequence.

Tree forward (`forward(ctx)`, the module call; HARTS §3.4-3.5): the compact rows C of a rollout-tree microbatch in
the plan's physical order, described by the `models.tree.layout.TreeLayout` its context `ctx` holds. The same layer
loop and the same `DecoderLayer.forward` run both: a layer asks its context (`FlatContext` or
`models.tree.mixers.TreeContext`) to run its token mixer, so only the mixers' row couplings differ; every row-wise
step (embeddings, norms, projections, MLP/MoE, LM head) runs once per compact row, and MoE statistics are weighted
by the rows' multiplicities.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from models.attention_core import VarlenCausalMask
from models.config import GatedAttentionConfig, GDNConfig, ModelConfig
from models.dtypes import DTYPES, upcast
from models.ffn import SwiGLU
from models.gated_attention import GatedAttention
from models.gdn import GatedDeltaNet
from models.kda import KimiDeltaAttention
from models.linear_attention import LinearAttention
from models.logprobs import compact_logprobs
from models.mla import MLA
from models.moe import MoE, MoEStats
from models.norms import RMSNorm
from models.ops.settings import KernelSettings
from models.recompute import LayerRecompute, SelectiveRecompute
from models.tree.layout import TreeLayout
from models.tree.mixers import TreeContext


@dataclass
class FlatContext:
    """What every layer needs for a flat packed forward."""

    position_ids: torch.Tensor
    """LongTensor `[T]`."""
    cu_seqlens: torch.Tensor
    """LongTensor `[N+1]`."""
    mask: VarlenCausalMask
    """Full-attention mask description."""

    @property
    def row_weight(self) -> None:
        """Every row counts once in MoE statistics."""
        return None

    def mix(self, mixer: nn.Module, h_TD: torch.Tensor) -> torch.Tensor:
        """The layer's token mixer on normed rows `[T, D]` -> `[T, D]`: attention causal inside each sequence,
        linear attention and its conv from zero states at every sequence."""
        if isinstance(mixer, LinearAttention):
            return mixer(h_TD, self.cu_seqlens)
        return mixer(h_TD, self.position_ids, self.mask)


@dataclass
class DecoderOutput:
    hidden: torch.Tensor
    """`[T, D]` (or `[B, T, D]`) final-normed hidden states."""
    moe_stats: list[MoEStats | None]
    """Per layer: router statistics of MoE layers, None for dense layers."""


@dataclass
class CausalLMOutput(DecoderOutput):
    logits: torch.Tensor | None = None
    """`[T, V]` (or `[B, T, V]`) logits in the model dtype."""


@dataclass
class TreeLMOutput(DecoderOutput):
    """Tree forward: `hidden` `[C, D]` of the compact rows in physical order, multiplicity-weighted MoE stats."""

    logprobs: torch.Tensor | None = None
    """`[S]` semantic log-probabilities in original order (0 for first tokens), fp32 (float64 for float64)."""
    entropy: torch.Tensor | None = None
    """`[S]` entropies of the predictive distributions when asked, else None."""


def mixer_attribute(config: ModelConfig, layer_type: str) -> str:
    """Attribute name of a layer's token mixer: Qwen3-Next calls its linear attention `linear_attn`; every other
    mixer is `self_attn`."""
    if layer_type == "linear_attention" and config.family == "qwen3_next":
        return "linear_attn"
    return "self_attn"


class DecoderLayer(nn.Module):
    """x = x + mixer(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x)), the first residual add inside
    `post_attention_layernorm` (`RMSNorm` with a residual)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.ffn_type = config.ffn_types[layer_idx]
        D, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered_norm
        if self.layer_type == "full_attention":
            if isinstance(config.full_attention, GatedAttentionConfig):
                mixer = GatedAttention(config.full_attention, D, eps, zc)
            else:
                mixer = MLA(config.full_attention, D, zc)
        elif isinstance(config.linear_attention, GDNConfig):
            mixer = GatedDeltaNet(config.linear_attention, D, eps)
        else:
            mixer = KimiDeltaAttention(config.linear_attention, D, eps)
        self.mixer_name = mixer_attribute(config, self.layer_type)
        setattr(self, self.mixer_name, mixer)
        self.mlp = SwiGLU(D, config.dense_ffn.intermediate_size) if self.ffn_type == "dense" else MoE(config.moe, D)
        self.input_layernorm = RMSNorm(D, eps, zc)
        self.post_attention_layernorm = RMSNorm(D, eps, zc)
        self.recompute: LayerRecompute | None = None

    @property
    def mixer(self) -> GatedAttention | MLA | GatedDeltaNet | KimiDeltaAttention:
        return getattr(self, self.mixer_name)

    def forward(self, x_TD: torch.Tensor, ctx: FlatContext | TreeContext) -> tuple[torch.Tensor, MoEStats | None]:
        """x `[T, D]` (compact rows `[C, D]` under a TreeContext) -> (x, MoE statistics or None for a dense FFN).

        With `recompute` set (and grad enabled) the part it names is recomputed in backward from the same `ctx`,
        inside this module's call (so inside its FSDP2 unit, after the unit's parameters are gathered).
        """
        r = self.recompute
        if r is None or not torch.is_grad_enabled():
            return self._residual_blocks(x_TD, ctx)
        if r.part == "layer":
            return r.run(self._residual_blocks, x_TD, ctx)
        m_TD = r.run(self._mixer_block, x_TD, ctx) if r.part == "mixer" else self._mixer_block(x_TD, ctx)
        return r.run(self._ffn_block, m_TD, x_TD, ctx) if r.part == "ffn" else self._ffn_block(m_TD, x_TD, ctx)

    def _residual_blocks(
        self, x_TD: torch.Tensor, ctx: FlatContext | TreeContext
    ) -> tuple[torch.Tensor, MoEStats | None]:
        return self._ffn_block(self._mixer_block(x_TD, ctx), x_TD, ctx)

    def _mixer_block(self, x_TD: torch.Tensor, ctx: FlatContext | TreeContext) -> torch.Tensor:
        """The token mixer's output `[T, D]` on the normed rows (before the residual add)."""
        return ctx.mix(self.mixer, self.input_layernorm(x_TD))

    def _ffn_block(
        self, m_TD: torch.Tensor, x_TD: torch.Tensor, ctx: FlatContext | TreeContext
    ) -> tuple[torch.Tensor, MoEStats | None]:
        """Mixer output m and layer input x `[T, D]` -> (layer output `[T, D]`, MoE statistics or None)."""
        # The mixer's residual add is fused into the second norm (one pass on CUDA), which returns the sum too.
        h_TD, x_TD = self.post_attention_layernorm(m_TD, x_TD)
        if self.ffn_type == "moe":
            h_TD, stats = self.mlp(h_TD, ctx.row_weight)
        else:
            h_TD, stats = self.mlp(h_TD), None
        return x_TD + h_TD, stats


class HybridModel(nn.Module):
    """`embed_tokens`, `layers`, `norm` (transformers' `model` submodule)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)


def run_layers(layers: Iterable[DecoderLayer], x_TD: torch.Tensor,
               ctx: FlatContext | TreeContext) -> tuple[torch.Tensor, list[MoEStats | None]]:
    """The layer loop of every forward (the whole model's, and one pipeline stage's): rows `[T, D]` through
    `layers` in order -> (rows `[T, D]`, per layer its MoE statistics or None). Each layer is entered as a module,
    so wrappers that hook `forward` (FSDP2) see it."""
    stats: list[MoEStats | None] = []
    for layer in layers:
        x_TD, s = layer(x_TD, ctx)
        stats.append(s)
    return x_TD, stats


def temperature_scaled(hidden_CD: torch.Tensor, temperature: float) -> torch.Tensor:
    """Final-normed rows `[C, D]` divided by the sampling temperature: the LM head then gives the logits of
    softmax(logits / temperature), the distribution a rollout engine sampled from."""
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    return hidden_CD if temperature == 1.0 else hidden_CD / temperature


def flat_context(T: int, position_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None, device) -> FlatContext:
    """Validate packed inputs and fill defaults: one sequence if no cu_seqlens; positions restart per sequence."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.long, device=device)
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
    if cu_seqlens.dim() != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or (cu_seqlens.diff() <= 0).any():
        raise ValueError(
            f"`cu_seqlens` must be increasing offsets from 0 to the number of tokens {T}, got {cu_seqlens.tolist()}"
        )
    if position_ids is None:
        starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
        position_ids = torch.arange(T, device=device) - starts
    elif position_ids.shape != (T,):
        raise ValueError(f"`position_ids` must have shape [{T}], got {tuple(position_ids.shape)}")
    return FlatContext(position_ids.to(device=device, dtype=torch.long), cu_seqlens, VarlenCausalMask(cu_seqlens))


class HybridForCausalLM(nn.Module):
    """The decoder with its LM head (`model`, `lm_head`; no `lm_head` module when embeddings are tied), running its
    ops on the kernels `kernels` names (`models.ops.settings.KernelSettings`; `use_kernels` changes them)."""

    def __init__(self, config: ModelConfig, kernels: KernelSettings = KernelSettings()):
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        self.to(DTYPES[config.dtype])
        self.keep_upcast_buffers()
        self.use_kernels(kernels)

    def use_kernels(self, kernels: KernelSettings) -> None:
        """Run this model's ops on `kernels` from now on: the model and each of its modules that dispatches to a
        kernel (those with a `kernels` attribute: norms, FFNs, experts, mixers) hold it and pass their ops what it
        says. Not process-wide: another model keeps its own. Call it before wrapping the model (FSDP2, compile,
        pipeline stages), as a job does once it has resolved `train.attention_kernels` for the model."""
        for module in self.modules():
            if isinstance(getattr(module, "kernels", None), KernelSettings):
                module.kernels = kernels
        self.kernels = kernels

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V, D]` output projection (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def keep_upcast_buffers(self) -> None:
        """Expert-score biases stay fp32 (float64 in float64 models): their updates are below bf16 resolution."""
        dtype = upcast(DTYPES[self.config.dtype])
        for module in self.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.data = module.e_score_correction_bias.data.to(dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random initialisation as transformers: normal(0, initializer_range) for projections, embeddings, routers
        and experts; norms to their identity; mixer-specific gate parameters by their own `reset_parameters`."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, MoE):
                nn.init.normal_(module.gate.weight, std=std)
                nn.init.normal_(module.experts.gate_up_proj, std=std)
                nn.init.normal_(module.experts.down_proj, std=std)
                if module.config.expert_bias:
                    module.gate.e_score_correction_bias.zero_()
            if module is not self and hasattr(module, "reset_parameters") and not isinstance(
                module, (nn.Linear, nn.Embedding, nn.Conv1d)
            ):
                module.reset_parameters()

    def set_activation_checkpointing(self, layers: bool | Iterable[int] | SelectiveRecompute) -> None:
        """Recompute activations in backward: True = every layer whole ("full"), False = none, layer ids = those
        layers whole, a `SelectiveRecompute` = the layers, part and saved ops it chooses."""
        if isinstance(layers, SelectiveRecompute):
            choices = layers.per_layer(self.config)
        else:
            chosen = set(range(self.config.num_layers)) if layers is True else set() if layers is False else set(layers)
            choices = [LayerRecompute() if i in chosen else None for i in range(self.config.num_layers)]
        for layer, choice in zip(self.model.layers, choices):
            layer.recompute = choice

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> DecoderOutput:
        """Final-normed hidden states of a flat forward.

        Args:
            input_ids: LongTensor `[T]` (packed rows) or `[B, T]` (B equal-length sequences; then no cu_seqlens or
                position_ids).
            position_ids: LongTensor `[T]`; default: restart at 0 in every sequence.
            cu_seqlens: LongTensor `[N+1]`; default: one sequence.
        Returns: DecoderOutput with hidden `[T, D]` (`[B, T, D]`) and per-layer MoE stats.
        """
        batch_shape = None
        if input_ids.dim() == 2:
            if position_ids is not None or cu_seqlens is not None:
                raise ValueError("`[B, T]` input_ids take no `position_ids` / `cu_seqlens`: pack them as `[T]` rows")
            batch_shape = input_ids.shape
            B, L = batch_shape
            cu_seqlens = torch.arange(0, B * L + 1, L, device=input_ids.device)
            input_ids = input_ids.reshape(-1)
        elif input_ids.dim() != 1:
            raise ValueError(f"`input_ids` must be [T] or [B, T], got shape {tuple(input_ids.shape)}")
        ctx = flat_context(input_ids.shape[0], position_ids, cu_seqlens, input_ids.device)
        out = self.decode(self.model.embed_tokens(input_ids), ctx)
        if batch_shape is not None:
            out.hidden = out.hidden.view(*batch_shape, -1)
        return out

    def tree_hidden_states(self, ctx: TreeContext) -> DecoderOutput:
        """Final-normed hidden states `[C, D]` of the physical rows of `ctx.layout` and per-layer MoE statistics
        (multiplicity-weighted), the layers mixing under `ctx` (a `TreeContext` with its full-attention backend, or
        the prefix carry's `models.tree.carry_exchange.CarryContext`)."""
        layout = ctx.layout
        linear = self.config.linear_attention
        if linear is not None and linear.chunk_size != layout.chunk_size:
            raise ValueError(
                f"the plan was made with chunk_size {layout.chunk_size} but the model's linear attention uses "
                f"{linear.chunk_size}: plan with planner.calls.plan.plan_calls(batch, chunk_size={linear.chunk_size})"
            )
        return self.decode(self.model.embed_tokens(layout.tokens), ctx)

    def decode(self, x_TD: torch.Tensor, ctx: FlatContext | TreeContext) -> DecoderOutput:
        """Both forwards after the embedding: rows `[T, D]` -> `run_layers` -> final norm, with per-layer MoE
        statistics."""
        x_TD, stats = run_layers(self.model.layers, x_TD, ctx)
        return DecoderOutput(self.model.norm(x_TD), stats)

    def compact_logprobs(
        self, hidden_CD: torch.Tensor, layout: TreeLayout, chunk_rows: int | None = None, entropy: bool = False
    ):
        """Semantic log-probabilities `[S]` (and entropies `[S]` if asked) of the LM head over tree hidden states
        `[C, D]` (`models.logprobs.compact_logprobs`). A tensor-parallel model overrides this with its
        vocabulary-parallel version."""
        return compact_logprobs(
            hidden_CD, self.lm_head_weight, layout.logit_row, layout.target, chunk_rows=chunk_rows, entropy=entropy,
            fused=self.kernels.fused_rowwise,
        )

    def forward(self, ctx: TreeContext, *, chunk_rows: int | None = None, entropy: bool = False,
                temperature: float = 1.0) -> TreeLMOutput:
        """The tree forward of one microbatch: `tree_hidden_states(ctx)` plus `compact_logprobs` (`chunk_rows`: rows
        per vocabulary chunk, default ~512 MiB of fp32 scratch). Log-probs and entropies are those of
        softmax(logits / temperature), the distribution a rollout engine sampled from: the final-normed rows `[C, D]`
        are divided by the temperature before the LM head (`hidden` of the output stays undivided).

        Tree execution enters the model as a module this way (`model(ctx, ...)`), so that a wrapper of the root
        (FSDP2's unit of embeddings, final norm and LM head) sees the whole step. The flat packed forward is
        `flat_forward` (and `hidden_states`).
        """
        out = self.tree_hidden_states(ctx)
        result = self.compact_logprobs(temperature_scaled(out.hidden, temperature), ctx.layout, chunk_rows, entropy)
        logprobs, entropy_S = result if entropy else (result, None)
        return TreeLMOutput(out.hidden, out.moe_stats, logprobs, entropy_S)

    def flat_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """`hidden_states` plus logits over the whole vocabulary (use `hidden_states` + `lm_head_weight` with
        `models.logprobs` to avoid materialising [T, V])."""
        out = self.hidden_states(input_ids, position_ids, cu_seqlens)
        return CausalLMOutput(out.hidden, out.moe_stats, out.hidden @ self.lm_head_weight.T)
