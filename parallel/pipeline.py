"""Pipeline parallelism (torch >= 2.14): the decoder layers split into stages over the pp ranks of each replica.

Legend: C compact rows of a microbatch, Cm the largest C of the step on this replica, D model dim, E experts,
M MoE layers, S semantic positions.

Stages follow torchtitan 0.3.0: its layer split (`_generate_llm_fqn_per_model_part`, embedding and head each weighted
as one layer), one stage per rank for "1F1B" and two, looped (stage s on pp rank s mod pp), for
"Interleaved1F1B"; FSDP2 per layer and per stage root without resharding after forward (`parallel.fsdp`). The
embedding runs on the first stage, the final norm and the compact log-probs (and through them the loss) on the last.
The schedules that run the stages are `parallel.pipeline_runner.PipelineRunner`'s.

Only tensors flow between stages: the hidden rows and, once an MoE layer has run, the router statistics of the MoE
layers so far, packed into one vector (so the loss on the last stage sees `moe_stats` of every layer, and z-loss /
balance gradients flow back to the stages that made them). Stage activations are padded to Cm rows
(`parallel.pipeline_runner` says why); stages slice the C real rows, and the padding gets zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from models.config import ModelConfig
from models.decoder import HybridForCausalLM, run_layers, temperature_scaled
from models.dtypes import DTYPES, upcast
from models.logprobs import compact_logprobs
from models.moe import MoEStats
from models.tree.mixers import TreeContext
from parallel.config import ParallelConfig
from parallel.fsdp import apply_fsdp
from parallel.mesh import ParallelMeshes
from parallel.parallelize import apply_compile

__all__ = ["PipelinedCausalLM", "stage_layers", "pipeline_hybrid", "pipeline_for_job", "pack_stats", "unpack_stats"]

def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Decoder layers of each stage, by torchtitan's split (embedding and head count as one layer each)."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    parts = _generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight=1, output_weight=1)
    counts = [sum(name.startswith("layers.") for name in part) for part in parts]
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


def pack_stats(stats: list[MoEStats]) -> torch.Tensor:
    """`[M * (2 + 2E)]`: per MoE layer tokens, z_sum, expert_counts, prob_mass."""
    return torch.cat([torch.cat([s.tokens[None], s.z_sum[None], s.expert_counts, s.prob_mass]) for s in stats])


def unpack_stats(packed: torch.Tensor | None, num_experts: int) -> list[MoEStats]:
    if packed is None:
        return []
    E = num_experts
    return [MoEStats(tokens=r[0].detach(), expert_counts=r[2:2 + E].detach(), prob_mass=r[2 + E:], z_sum=r[1])
            for r in packed.view(-1, 2 + 2 * E)]


class PipelinePart(nn.Module):
    """One stage: the embedding (first), decoder layers, final norm and LM head (last), under the whole model's
    parameter names. Shares its modules with the model it was cut from, and runs its kernels (`model.kernels`)."""

    def __init__(self, model: HybridForCausalLM, layers: range, first: bool, last: bool):
        super().__init__()
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        self.is_first, self.is_last = first, last
        self.kernels = model.kernels
        self.num_experts = model.config.moe.num_experts if model.config.moe is not None else 0

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None, *, ctx: TreeContext,
                chunk_rows: int | None = None, temperature: float = 1.0,
                entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """x: token ids `[Cm]` (first stage) or hidden rows `[Cm, D]`; stats: packed MoE statistics of the layers
        before, if any. Returns (hidden `[Cm, D]`, [stats]) to the next stage, or on the last stage (log-probs `[S]`
        of softmax(logits / temperature), final-normed hidden `[C, D]`, [entropies `[S]`], [stats of all MoE
        layers]): what `HybridForCausalLM.forward(ctx, temperature=...)` returns to the loss."""
        C = ctx.layout.tokens.shape[0]
        h_CD = self.model.embed_tokens(x[:C]) if self.is_first else x[:C]
        h_CD, layer_stats = run_layers(self.model.layers.values(), h_CD, ctx)
        moe = unpack_stats(stats, self.num_experts) + [s for s in layer_stats if s is not None]
        packed = (pack_stats(moe),) if moe else ()
        if not self.is_last:
            return (F.pad(h_CD, (0, 0, 0, x.shape[0] - C)), *packed)
        hidden_CD = self.model.norm(h_CD)
        layout = ctx.layout
        result = compact_logprobs(temperature_scaled(hidden_CD, temperature), self.lm_head.weight, layout.logit_row,
                                  layout.target, chunk_rows=chunk_rows, entropy=entropy,
                                  fused=self.kernels.fused_rowwise)
        logprobs_S, *entropy_S = result if entropy else (result,)
        return (logprobs_S, hidden_CD, *entropy_S, *packed)


class PipelinedCausalLM(nn.Module):
    """This rank's stages of a HybridForCausalLM. Its parameters (for optimizers, clipping, DCP) are the local ones,
    named as in the whole model (`model.layers.{i}...`); `parts` are the stage modules that the schedule runs."""

    def __init__(self, model: HybridForCausalLM, config: ParallelConfig, meshes: ParallelMeshes,
                 device: torch.device):
        super().__init__()
        self.config: ModelConfig = model.config
        self.parallel = config
        pp_mesh = meshes.dense["pp"]
        self.pp_group = pp_mesh.get_group()
        self.device = device
        per_rank = 2 if issubclass(get_schedule_class(config.pp_schedule), PipelineScheduleMulti) else 1
        self.num_stages = config.pp * per_rank
        pp_rank = pp_mesh.get_local_rank()
        self.stage_indices = tuple(pp_rank + k * config.pp for k in range(per_rank))
        self.stage_layers = stage_layers(model.config.num_layers, self.num_stages)
        last = self.num_stages - 1
        self.parts = tuple(PipelinePart(model, self.stage_layers[s], s == 0, s == last) for s in self.stage_indices)
        # The whole model's names for the local modules (parts are kept in a tuple: not registered twice).
        self.model = nn.Module()
        if 0 in self.stage_indices:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({k: v for p in self.parts for k, v in p.model.layers.items()})
        if last in self.stage_indices:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        # The hidden rows between stages are in FSDP2's compute dtype.
        self.activation_dtype = DTYPES[config.param_dtype if config.param_dtype != "model" else model.config.dtype]

    @property
    def last_stage_rank(self) -> int:
        """pp rank (in `pp_group`) holding the last stage, where the losses are."""
        return (self.num_stages - 1) % self.parallel.pp

    def moe_layers_before(self, stage: int) -> int:
        return sum(t == "moe" for t in self.config.ffn_types[:self.stage_layers[stage].start])

    def stage_metadata(self, stage: int, rows: int,
                       entropy: bool) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Example (meta-device) inputs and outputs of a stage for `rows` padded rows: what PipelineStage allocates
        receive buffers from. The last stage's outputs go to the loss, not to a peer, but torch wants one entry per
        output all the same (a one-position vector stands for `[S]`, a `[Cm, D]` one for `[C, D]`)."""
        D, E = self.config.hidden_size, self.parts[0].num_experts
        stats_dtype = upcast(self.activation_dtype)

        def boundary(moe_layers: int) -> tuple[torch.Tensor, ...]:
            hidden = torch.empty(rows, D, dtype=self.activation_dtype, device="meta", requires_grad=True)
            if not moe_layers:
                return (hidden,)
            return hidden, torch.empty(moe_layers * (2 + 2 * E), dtype=stats_dtype, device="meta", requires_grad=True)

        first, last = stage == 0, stage == self.num_stages - 1
        inputs = (torch.empty(rows, dtype=torch.long, device="meta"),) if first else boundary(
            self.moe_layers_before(stage))
        moe_through = self.moe_layers_before(stage) + sum(
            self.config.ffn_types[i] == "moe" for i in self.stage_layers[stage])
        if not last:
            return inputs, boundary(moe_through)
        per_position = torch.empty(1, dtype=stats_dtype, device="meta", requires_grad=True)
        hidden, *stats = boundary(moe_through)
        return inputs, (per_position, hidden, *((per_position,) if entropy else ()), *stats)


def pipeline_hybrid(model: HybridForCausalLM, meshes: ParallelMeshes, config: ParallelConfig,
                    device: torch.device) -> PipelinedCausalLM:
    """The pipeline counterpart of `parallel.parallelize_hybrid` (pp > 1): activation checkpointing and compile on
    `model` (on `device`), then this rank's stages with FSDP2. The stages take over `model`'s modules; drop `model`
    afterwards (the other stages' layers are freed with it)."""
    config.validate(model.config, pipelined=True)
    model.set_activation_checkpointing(config.recompute())
    if config.compile:
        apply_compile(model, config.compile_backend)
    pipelined = PipelinedCausalLM(model, config, meshes, device)
    apply_fsdp(pipelined.parts, meshes, config, pp_enabled=True)
    return pipelined


def pipeline_for_job(model: HybridForCausalLM, job) -> PipelinedCausalLM:
    """`parallel.parallelize_for_job` for pp > 1: `model` (same on every rank) to the job's device, then
    `pipeline_hybrid`."""
    return pipeline_hybrid(model.to(job.device), job.meshes, job.config, job.device)
