"""Mixture-of-experts FFN: top-k router, routed SwiGLU experts, optional shared expert, and sum-based router stats.

Legend: T tokens (rows), D model dim, E experts, k experts per token, F expert hidden width.

Routing (per row, in fp32; float64 for float64 models): logits = W x; scores s = softmax(logits) or sigmoid(logits); the
k experts maximise s + b (b = `e_score_correction_bias` when `expert_bias`, else 0; with `num_groups` > 1 only inside
the `topk_groups` groups with the largest sums of their top-2 s + b); combine weights w_e = s_e, divided by their sum
when `norm_topk_prob`, times `routed_scaling_factor`. Output = sum_e w_e expert_e(x) + shared(x), where shared(x) is
scaled by sigmoid(shared_expert_gate x) when gated. This reproduces transformers' Qwen3NextSparseMoeBlock (softmax,
gated shared expert) and KimiLinearMoE (sigmoid, bias, scaling, ungated shared experts).

The logits GEMM always runs on blocks of `ROUTER_BLOCK_ROWS` rows (the last one zero-padded): BLAS libraries pick
their kernel and split of the reduction by the problem's shape, so with one call per batch a row's fp32 logits
could differ in the last bit between a flat microbatch and a tree microbatch of other size; that bit decides the bf16
rounding of a combine weight now and then, and full attention spreads such a row's change to every descendant
(measured: `python -m bench.fidelity --device cuda --dtype bfloat16 --per-layer`). With one shape the logits of a
row do not depend on the other rows of the call.

Router statistics are sums over rows, each row weighted by `row_weight` (tree execution passes the multiplicity of
a compact row, so a row that stands for q trajectory tokens counts q times), so they add across layers and
microbatches (`MoEStats.__add__`):
    tokens        = sum_t w_t
    expert_counts = sum_t w_t [e in topk(t)]                      (no gradient; also the expert-bias load)
    prob_mass     = sum_t w_t p_{t,e}, p = softmax(logits) for softmax routers, s / sum(s) for sigmoid routers
    z_sum         = sum_t w_t logsumexp(logits_t)^2
Losses are per-batch and token-level (one pool of tokens, not per sequence):
    load_balancing_loss = E * sum_e (expert_counts_e / tokens) * (prob_mass_e / tokens)
    router_z_loss       = z_sum / tokens
Pooling the stats of all layers before `load_balancing_loss` gives exactly transformers' `load_balancing_loss_func`
(which pools counts and probabilities over layers); calling it per layer and summing is the Switch/GShard form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.config import MoEConfig
from models.dtypes import mm_upcast, upcast
from models.experts import expert_swiglu
from models.ffn import SwiGLU
from models.ops.combine import moe_combine
from models.ops.settings import KernelSettings


@dataclass
class Routing:
    """Per-row routing decision."""

    logits: torch.Tensor
    """`[T, E]` fp32 router logits."""
    scores: torch.Tensor
    """`[T, E]` fp32 softmax or sigmoid scores (without expert bias)."""
    experts: torch.Tensor
    """`[T, k]` chosen experts."""
    weights: torch.Tensor
    """`[T, k]` fp32 combine weights."""


@dataclass
class MoEStats:
    """Row-weighted sums of one MoE layer's routing (see the module docstring); add to combine."""

    tokens: torch.Tensor
    """`[]` sum of row weights."""
    expert_counts: torch.Tensor
    """`[E]` weighted number of top-k assignments per expert (detached)."""
    prob_mass: torch.Tensor
    """`[E]` weighted routing probability per expert (differentiable)."""
    z_sum: torch.Tensor
    """`[]` weighted sum of squared router log-sum-exp (differentiable)."""

    def __add__(self, other: MoEStats) -> MoEStats:
        return MoEStats(
            self.tokens + other.tokens,
            self.expert_counts + other.expert_counts,
            self.prob_mass + other.prob_mass,
            self.z_sum + other.z_sum,
        )


def pooled_stats(per_layer: list[MoEStats | None]) -> MoEStats | None:
    """The router statistics of all MoE layers of one forward (None for dense layers), pooled (transformers'
    load-balancing form); None without MoE layers."""
    stats = [s for s in per_layer if s is not None]
    if not stats:
        return None
    pooled = stats[0]
    for s in stats[1:]:
        pooled = pooled + s
    return pooled


def load_balancing_loss(stats: MoEStats) -> torch.Tensor:
    """E * sum_e f_e P_e with f = expert_counts / tokens, P = prob_mass / tokens."""
    E = stats.prob_mass.shape[0]
    return E * (stats.expert_counts / stats.tokens * (stats.prob_mass / stats.tokens)).sum()


def router_z_loss(stats: MoEStats) -> torch.Tensor:
    """Mean squared router log-sum-exp (ST-MoE z-loss)."""
    return stats.z_sum / stats.tokens


ROUTER_BLOCK_ROWS = 4096


def _blocks(x_TD: torch.Tensor) -> list[torch.Tensor]:
    """`x` as blocks of exactly `ROUTER_BLOCK_ROWS` rows, the last one zero-padded (only it is copied)."""
    blocks = list(x_TD.split(ROUTER_BLOCK_ROWS)) or [x_TD]
    blocks[-1] = F.pad(blocks[-1], (0, 0, 0, ROUTER_BLOCK_ROWS - blocks[-1].shape[0]))
    return blocks


def _rows(blocks: list[torch.Tensor], T: int) -> torch.Tensor:
    return (torch.cat(blocks) if len(blocks) > 1 else blocks[0])[:T]


def naive_router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """Reference of `router_logits`: `x @ weight.T` in the upcast dtype (fp32; float64 stays float64) -> `[T, E]`,
    as GEMMs of exactly `ROUTER_BLOCK_ROWS` rows each (see the module docstring)."""
    dtype = upcast(x_TD.dtype)
    weight = weight_ED.to(dtype)
    return _rows([F.linear(block, weight) for block in _blocks(x_TD.to(dtype))], x_TD.shape[0])


def _split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `t` as hi + lo in bf16 (16 significant bits, relative error <= 2^-17)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


class _BF16RouterLogits(torch.autograd.Function):
    """fp32 logits of bf16 rows and weights: block GEMMs on the inputs as they are, writing fp32 (`mm_upcast`:
    the exact products summed in fp32, like the reference's GEMM on upcast copies, only without the fp32 copies and
    with the tensor cores). Backward: each fp32 gradient split into two bf16 parts (`_split_bf16`), so the two
    input gradients are fp32 sums accurate to 2^-17 before their rounding to bf16."""

    @staticmethod
    def forward(ctx, x_TD, weight_ED):
        ctx.save_for_backward(x_TD, weight_ED)
        return _rows([mm_upcast(block, weight_ED.T, torch.float32) for block in _blocks(x_TD)], x_TD.shape[0])

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TD, weight_ED = ctx.saved_tensors
        hi_TE, lo_TE = _split_bf16(dlogits_TE.float())
        dx = dweight = None
        if ctx.needs_input_grad[0]:
            dx = (mm_upcast(hi_TE, weight_ED, torch.float32) + mm_upcast(lo_TE, weight_ED, torch.float32)).to(
                x_TD.dtype)
        if ctx.needs_input_grad[1]:
            dweight = (mm_upcast(hi_TE.T, x_TD, torch.float32) + mm_upcast(lo_TE.T, x_TD, torch.float32)).to(
                weight_ED.dtype)
        return dx, dweight


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` -> `[T, E]` fp32 (float64 for float64), as GEMMs of exactly `ROUTER_BLOCK_ROWS` rows each
    (see the module docstring): bf16 rows and weights run `_BF16RouterLogits` (on CUDA bf16 GEMMs writing fp32, in
    place of slower fp32 GEMMs on upcast copies: bench/RESULTS.md, "Profiled costs behind design choices"), other
    dtypes the reference `naive_router_logits`."""
    if x_TD.dtype == torch.bfloat16 and weight_ED.dtype == torch.bfloat16:
        return _BF16RouterLogits.apply(x_TD, weight_ED)
    return naive_router_logits(x_TD, weight_ED)


class Router(nn.Module):
    """`weight [E, D]` and, with `expert_bias`, the fp32 buffer `e_score_correction_bias [E]` (transformers' names)."""

    def __init__(self, config: MoEConfig, hidden_size: int):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        if config.expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        c = self.config
        dtype = upcast(x_TD.dtype)
        logits_TE = router_logits(x_TD, self.weight)
        scores_TE = logits_TE.softmax(-1) if c.score_func == "softmax" else logits_TE.sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias.to(dtype) if c.expert_bias else scores_TE
        if c.num_groups > 1:
            T = choice_TE.shape[0]
            group_scores = choice_TE.view(T, c.num_groups, -1).topk(2, dim=-1).values.sum(-1)  # [T, groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(c.topk_groups, dim=-1).indices, True)
            keep_TE = keep[:, :, None].expand(-1, -1, c.num_experts // c.num_groups).reshape(T, -1)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        experts_Tk = choice_TE.topk(c.top_k, dim=-1).indices
        weights_Tk = scores_TE.gather(1, experts_Tk)
        if c.norm_topk_prob:
            weights_Tk = weights_Tk / (weights_Tk.sum(-1, keepdim=True) + 1e-20)
        return Routing(logits_TE, scores_TE, experts_Tk, weights_Tk * c.routed_scaling_factor)

    def stats(self, routing: Routing, row_weight_T: torch.Tensor | None = None) -> MoEStats:
        """Row-weighted router statistics; row_weight `[T]` defaults to ones."""
        logits, scores = routing.logits, routing.scores
        w_T = torch.ones_like(logits[:, 0]) if row_weight_T is None else row_weight_T.to(logits)
        probs_TE = scores if self.config.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        k = routing.experts.shape[1]
        counts_E = torch.zeros_like(logits[0]).index_add_(
            0, routing.experts.reshape(-1), w_T.detach().repeat_interleave(k)
        )
        return MoEStats(
            tokens=w_T.detach().sum(),
            expert_counts=counts_E.detach(),
            prob_mass=(w_T[:, None] * probs_TE).sum(0),
            z_sum=(w_T * torch.logsumexp(logits, dim=-1).pow(2)).sum(),
        )

    @torch.no_grad()
    def update_expert_bias(self, expert_counts_E: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3): b_e += rate * sign(mean(counts) - counts_e)."""
        if not self.config.expert_bias:
            raise ValueError("`update_expert_bias` needs `MoEConfig.expert_bias = True`")
        counts = expert_counts_E.float()
        self.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)


class _DispatchRows(torch.autograd.Function):
    """x `[T, D]` -> its k routed copies `[M, D]` in expert order (`x[row_M]`); backward sums each row's k copy
    gradients with the combine (`moe_combine` with unit weights, slots `slot_Tk`: an fp32 sum in slot order, one
    rounding, no atomics; fused where `fused`), in place of the gather's slower accumulating scatter
    (bench/RESULTS.md, "Profiled costs behind design choices")."""

    @staticmethod
    def forward(ctx, x_TD, row_M, slot_Tk, fused):
        ctx.save_for_backward(slot_Tk)
        ctx.fused = fused
        return x_TD[row_M]

    @staticmethod
    def backward(ctx, dy_MD):
        (slot_Tk,) = ctx.saved_tensors
        ones_Tk = torch.ones(slot_Tk.shape, dtype=upcast(dy_MD.dtype), device=dy_MD.device)
        return moe_combine(dy_MD, slot_Tk, ones_Tk, fused=ctx.fused), None, None, None


def dispatch_rows(x_TD: torch.Tensor, row_M: torch.Tensor, slot_Tk: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """The routed copies `x[row_M]` `[M, D]` of rows `[T, D]`; `slot_Tk` `[T, k]` the copy of each (row, choice),
    the inverse of `row_M`. Backward sums each row's k copy gradients with the combine (`_DispatchRows`; its fused
    kernel where `fused`: a model's `KernelSettings.fused_rowwise`)."""
    return _DispatchRows.apply(x_TD, row_M, slot_Tk, fused)


class Experts(nn.Module):
    """Routed experts as transformers 5 stores them: `gate_up_proj [E, 2F, D]` (gate rows first),
    `down_proj [E, D, F]`."""

    kernels: KernelSettings = KernelSettings()
    """Which kernels its ops run (`models.ops.settings`); the model it belongs to sets it
    (`HybridForCausalLM.use_kernels`)."""

    def __init__(self, config: MoEConfig, hidden_size: int):
        super().__init__()
        E, F_ = config.num_experts, config.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, F_))

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sum over the k chosen experts of weight * expert(x) -> `[T, D]` in x.dtype.

        The k weighted expert outputs of a row are summed in the upcast dtype in a fixed order
        (`models.ops.combine.moe_combine`, one fused pass on CUDA unless `kernels.fused_rowwise` is off): a permutation
        back to (row, slot) order replaces an atomic scatter-add, so CUDA results are deterministic and bf16 rows are
        rounded once, not once per expert.
        """
        T, k = routing.experts.shape
        flat_expert = routing.experts.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        # Counts from the sorted ids (torch.bincount would synchronise with the host on CUDA).
        bounds = torch.arange(self.gate_up_proj.shape[0] + 1, device=flat_expert.device)
        counts_E = torch.searchsorted(flat_expert[order], bounds).diff()
        slot_of_row = torch.empty_like(order)
        slot_of_row[order] = torch.arange(order.numel(), device=order.device)
        slot_Tk = slot_of_row.view(T, k)
        fused = self.kernels.fused_rowwise
        y_MD = expert_swiglu(dispatch_rows(x_TD, order // k, slot_Tk, fused), self.gate_up_proj, self.down_proj,
                             counts_E, fused=fused)
        return moe_combine(y_MD, slot_Tk, routing.weights, fused=fused)


class MoE(nn.Module):
    """`gate` (Router), `experts`, and the shared expert: `shared_expert` + `shared_expert_gate` when gated
    (Qwen3-Next), `shared_experts` when not (Kimi-Linear)."""

    def __init__(self, config: MoEConfig, hidden_size: int):
        super().__init__()
        self.config = config
        self.gate = Router(config, hidden_size)
        self.experts = Experts(config, hidden_size)
        if config.shared_expert_gate:
            self.shared_expert = SwiGLU(hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        elif config.shared_expert_intermediate_size:
            self.shared_experts = SwiGLU(hidden_size, config.shared_expert_intermediate_size)

    def forward(self, x_TD: torch.Tensor, row_weight_T: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        """x `[T, D]`, optional row weights `[T]` (statistics only) -> (`[T, D]`, MoEStats)."""
        routing = self.gate(x_TD)
        return self.plus_shared(self.experts(x_TD, routing), x_TD), self.gate.stats(routing, row_weight_T)

    def plus_shared(self, y_TD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """`y` plus the shared expert's output on `x` (gated when the config says so); `y` itself without one."""
        if self.config.shared_expert_gate:
            return y_TD + torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        if self.config.shared_expert_intermediate_size:
            return y_TD + self.shared_experts(x_TD)
        return y_TD
