"""Pipeline parallelism (torch >= 2.14): the decoder layers split into stages over the pp ranks of each replica.

Legend: C compact rows of a microbatch, Cm the largest C of the step on this replica, D model dim, E experts,
M MoE layers, S semantic positions.

Stages follow torchtitan 0.3.0: its layer split (`_generate_llm_fqn_per_model_part`, embedding and head each weighted
as one layer), one stage per rank for "1F1B" and two, looped (stage s on pp rank s mod pp), for
"Interleaved1F1B"; schedules from `torch.distributed.pipelining` with `scale_grads=False`; FSDP2 per layer and per
stage root without resharding after forward. The embedding runs on the first stage, the final norm and the compact
log-probs (and through them the loss) on the last.

Per-microbatch inputs: every pp rank of a replica holds the replica's microbatches packed (`parallel.step.
pack_microbatch`: the planner is deterministic, so all ranks hold the same ones); the schedule gets them as
per-microbatch lists, `arg_mbs` (the first stage's token ids) and `kwarg_mbs` (the TreeContext and log-prob options,
given to every stage). Only tensors flow between stages: the hidden rows and, once an MoE layer has run, the router
statistics of the MoE layers so far, packed into one vector (so the loss on the last stage sees `moe_stats` of every
layer, and z-loss / balance gradients flow back to the stages that made them).

Varying C (measured on torch 2.14.1, gloo): a stage's receive buffers are allocated once per schedule from one
shape, either given (static metadata) or inferred from the first microbatch (dynamic inference, which also runs an
extra forward and backward of it). With inferred shapes a second microbatch of another C aborts gloo ("Received data
size doesn't match expected size"). So stage activations are padded to Cm rows (stages slice the C real rows; the
padding gets zero gradient), the stages get static metadata for Cm, and stages and schedule are rebuilt each step
(no communication to build; the schedule's first step exchanges one small vote per stage boundary).

Loss scaling is that of `parallel.step`: each microbatch loss is already divided by the step's global normalisers,
gradients are summed over microbatches (no schedule scaling) and replicas (FSDP2 sum), so they equal the
single-process gradient of the step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from models.config import ModelConfig
from models.decoder import HybridForCausalLM, TreeLMOutput
from models.dtypes import DTYPES, upcast
from models.logprobs import compact_logprobs
from models.moe import MoEStats
from models.tree.mixers import TreeContext
from parallel.config import ParallelConfig
from parallel.grad_norm import clip_grad_norm_
from parallel.mesh import ParallelMeshes
from parallel.parallelize import apply_compile
from parallel.step import Microbatch, MicrobatchLoss, StepMetrics, _checked, _step_metrics, pack_microbatch
from planner.trajectory import Trajectory

__all__ = ["PipelinedCausalLM", "stage_layers", "pipeline_hybrid", "pipeline_for_job", "pipeline_train_step",
           "pipeline_score", "pipeline_clip_grad_norm_"]


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Decoder layers of each stage, by torchtitan's split (embedding and head count as one layer each)."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    parts = _generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight=1, output_weight=1)
    counts = [sum(name.startswith("layers.") for name in part) for part in parts]
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


def _pack_stats(stats: list[MoEStats]) -> torch.Tensor:
    """`[M * (2 + 2E)]`: per MoE layer tokens, z_sum, expert_counts, prob_mass."""
    return torch.cat([torch.cat([s.tokens[None], s.z_sum[None], s.expert_counts, s.prob_mass]) for s in stats])


def _unpack_stats(packed: torch.Tensor | None, num_experts: int) -> list[MoEStats]:
    if packed is None:
        return []
    E = num_experts
    return [MoEStats(tokens=r[0].detach(), expert_counts=r[2:2 + E].detach(), prob_mass=r[2 + E:], z_sum=r[1])
            for r in packed.view(-1, 2 + 2 * E)]


class PipelinePart(nn.Module):
    """One stage: the embedding (first), decoder layers, final norm and LM head (last), under the whole model's
    parameter names. Shares its modules with the model it was cut from."""

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
        self.num_experts = model.config.moe.num_experts if model.config.moe is not None else 0

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None, *, ctx: TreeContext,
                chunk_rows: int | None = None, temperature: float = 1.0,
                entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """x: token ids `[Cm]` (first stage) or hidden rows `[Cm, D]`; stats: packed MoE statistics of the layers
        before, if any. Returns (hidden `[Cm, D]`, [stats]) to the next stage, or on the last stage (log-probs `[S]`
        of softmax(logits / temperature), final-normed hidden `[C, D]`, [entropies `[S]`], [stats of all MoE
        layers]): what `HybridForCausalLM.tree_forward(..., temperature=...)` returns to `parallel.step.train_step`."""
        C = ctx.layout.tokens.shape[0]
        h_CD = self.model.embed_tokens(x[:C]) if self.is_first else x[:C]
        moe = _unpack_stats(stats, self.num_experts)
        for layer in self.model.layers.values():
            h_CD, s = layer(h_CD, ctx)
            if s is not None:
                moe.append(s)
        packed = (_pack_stats(moe),) if moe else ()
        if not self.is_last:
            return (F.pad(h_CD, (0, 0, 0, x.shape[0] - C)), *packed)
        hidden_CD = self.model.norm(h_CD)
        layout = ctx.layout
        result = compact_logprobs(hidden_CD if temperature == 1.0 else hidden_CD / temperature, self.lm_head.weight,
                                  layout.logit_row, layout.target, chunk_rows=chunk_rows, entropy=entropy)
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


def _apply_fsdp(pipelined: PipelinedCausalLM, meshes: ParallelMeshes, config: ParallelConfig) -> None:
    """fully_shard each local layer and each stage root (`parallel.fsdp`'s policy; "default" = no resharding after
    forward, as torchtitan does under PP: every microbatch would gather the parameters again)."""
    dtypes = {"model": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
    mp_policy = MixedPrecisionPolicy(param_dtype=dtypes[config.param_dtype], reduce_dtype=dtypes[config.reduce_dtype],
                                     cast_forward_inputs=False)
    reshard = config.reshard_after_forward == "always"
    for part in pipelined.parts:
        for layer in part.model.layers.values():
            fully_shard(layer, mesh=meshes.dense_fsdp, mp_policy=mp_policy, reshard_after_forward=reshard)
        fully_shard(part, mesh=meshes.dense_fsdp, mp_policy=mp_policy, reshard_after_forward=reshard)
    gloo = dist.get_backend() == "gloo"
    for part in pipelined.parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                if gloo:
                    module.set_force_sum_reduction_for_comms(True)


def pipeline_hybrid(model: HybridForCausalLM, meshes: ParallelMeshes, config: ParallelConfig,
                    device: torch.device) -> PipelinedCausalLM:
    """The pipeline counterpart of `parallel.parallelize_hybrid` (pp > 1): activation checkpointing and compile on
    `model` (on `device`), then this rank's stages with FSDP2. The stages take over `model`'s modules; drop `model`
    afterwards (the other stages' layers are freed with it)."""
    config.validate(model.config, pipelined=True)
    model.set_activation_checkpointing(config.activation_checkpointing == "full")
    if config.compile:
        apply_compile(model, config.compile_backend)
    pipelined = PipelinedCausalLM(model, config, meshes, device)
    _apply_fsdp(pipelined, meshes, config)
    return pipelined


def pipeline_for_job(model: HybridForCausalLM, job) -> PipelinedCausalLM:
    """`parallel.parallelize_for_job` for pp > 1: `model` (same on every rank) to the job's device, then
    `pipeline_hybrid`."""
    return pipeline_hybrid(model.to(job.device), job.meshes, job.config, job.device)


def _schedule(model: PipelinedCausalLM, rows: int, n_microbatches: int, entropy: bool, sink):
    """Stages with static metadata for `rows` padded rows, and the configured schedule; `sink(outputs, index)` is
    its loss function (called on the last stage with each microbatch's outputs and index)."""
    stages = []
    for part, s in zip(model.parts, model.stage_indices):
        inputs, outputs = model.stage_metadata(s, rows, entropy)
        stages.append(PipelineStage(part, s, model.num_stages, model.device, input_args=inputs, output_args=outputs,
                                    group=model.pp_group))
    cls = get_schedule_class(model.parallel.pp_schedule)
    if issubclass(cls, PipelineScheduleMulti):
        return cls(stages, n_microbatches=n_microbatches, loss_fn=sink, scale_grads=False)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=sink, scale_grads=False)


def _run(model: PipelinedCausalLM, microbatches: Sequence[Microbatch], sink, *, train: bool, attention_backend: str,
         chunk_rows: int | None, temperature: float, entropy: bool) -> float:
    """One pass of the schedule over the microbatches (forward and backward if `train`, else forward only); returns
    the host seconds this rank spent in stage forwards."""
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    rows = max(mb.batch.num_compact for mb in microbatches)
    n = len(microbatches)
    schedule = _schedule(model, rows, n, entropy, sink)
    tokens = [(F.pad(mb.layout.tokens, (0, rows - mb.layout.tokens.shape[0])),) for mb in microbatches]
    contexts = [{"ctx": TreeContext(mb.layout, attention_backend), "chunk_rows": chunk_rows,
                 "temperature": temperature, "entropy": entropy} for mb in microbatches]
    forward_seconds = [0.0]
    started: list[float] = []

    def before(module, args, kwargs):
        started.append(time.perf_counter())

    def after(module, args, kwargs, output):
        forward_seconds[0] += time.perf_counter() - started.pop()

    handles = [h for part in model.parts for h in (part.register_forward_pre_hook(before, with_kwargs=True),
                                                   part.register_forward_hook(after, with_kwargs=True))]
    try:
        if train:
            schedule.step(arg_mbs=tokens, kwarg_mbs=contexts, target_mbs=list(range(n)), return_outputs=False)
        else:
            schedule.eval(arg_mbs=tokens, kwarg_mbs=contexts, target_mbs=list(range(n)))
    finally:
        for h in handles:
            h.remove()
    return forward_seconds[0]


def _tree_output(model: PipelinedCausalLM, outputs: tuple[torch.Tensor, ...], entropy: bool) -> TreeLMOutput:
    """The last stage's outputs as the TreeLMOutput that `parallel.step.train_step` hands to the loss."""
    logprobs_S, hidden_CD, *rest = outputs
    entropy_S = rest.pop(0) if entropy else None
    stats = iter(_unpack_stats(rest[0] if rest else None, model.parts[-1].num_experts))
    moe_stats = [next(stats) if t == "moe" else None for t in model.config.ffn_types]
    return TreeLMOutput(hidden_CD, moe_stats, logprobs_S, entropy_S)


def _from_last_stage(model: PipelinedCausalLM, value):
    """`value` of the last stage's rank (CPU tensors / Python objects), on every rank of the pp group."""
    box = [value if dist.get_rank(model.pp_group) == model.last_stage_rank else None]
    dist.broadcast_object_list(box, group=model.pp_group, group_src=model.last_stage_rank)
    return box[0]


def _packed(model: PipelinedCausalLM, microbatches, dp_group) -> list[Microbatch]:
    _checked(microbatches, dp_group, model.device)
    return [mb if isinstance(mb, Microbatch) else pack_microbatch(mb, model.config, model.device)
            for mb in microbatches]


def pipeline_train_step(
    model: PipelinedCausalLM,
    microbatches: Sequence[Microbatch | Sequence[Trajectory]],
    loss_fn: MicrobatchLoss,
    *,
    dp_group: dist.ProcessGroup | None = None,
    attention_backend: str = "dense",
    chunk_rows: int | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> StepMetrics:
    """`parallel.step.train_step` for a PipelinedCausalLM (same arguments, loss callback and result): forward and
    backward of this replica's microbatches through the pipeline schedule. `loss_fn` runs on the last stage; the
    StepMetrics (loss, loss metrics, expert loads of every layer, non-finite microbatch) are the same on every pp
    rank. `forward_seconds`: this rank's stage forwards and losses; `backward_seconds`: the rest of the schedule
    (backward, recomputation, waiting for neighbouring stages)."""
    mbs = _packed(model, microbatches, dp_group)
    if model.parallel.pp_schedule == "1F1B" and len(mbs) < model.num_stages:
        raise ValueError(
            f"{len(mbs)} microbatches on this replica but the 1F1B schedule needs at least `parallel.pp` = "
            f"{model.num_stages}: plan more microbatches (smaller planner capacity) or set `parallel.pp_schedule` "
            "= 'Interleaved1F1B'"
        )
    results: list[tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]] = []
    loss_seconds = [0.0]

    def sink(outputs: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        start = time.perf_counter()
        output = _tree_output(model, outputs, entropy)
        loss, metrics = loss_fn(output.logprobs, mbs[index].batch, output)
        results.append((loss.detach().to(torch.float64), {k: v.detach() for k, v in metrics.items()},
                        [s.expert_counts for s in output.moe_stats if s is not None]))
        loss_seconds[0] += time.perf_counter() - start
        return loss

    start = time.perf_counter()
    forward_seconds = _run(model, mbs, sink, train=True, attention_backend=attention_backend, chunk_rows=chunk_rows,
                           temperature=temperature, entropy=entropy) + loss_seconds[0]
    total_seconds = time.perf_counter() - start
    summary = None
    if results:
        extras: dict[str, float] = {}
        for _, metrics, _ in results:
            for k, v in metrics.items():
                extras[k] = extras.get(k, 0.0) + float(v.to(torch.float64))
        counts = [torch.stack(c).sum(0).cpu() for c in zip(*(r[2] for r in results))]
        summary = (torch.stack([r[0] for r in results]).cpu(), extras, counts)
    losses_K, extras, counts = _from_last_stage(model, summary)
    it = iter(c.to(model.device) for c in counts)
    return _step_metrics(
        [mb.batch for mb in mbs], sum(mb.linear_attention_calls for mb in mbs), losses_K, extras,
        [next(it) if t == "moe" else None for t in model.config.ffn_types], forward_seconds,
        total_seconds - forward_seconds,
    )


@torch.no_grad()
def pipeline_score(
    model: PipelinedCausalLM,
    microbatches: Sequence[Microbatch],
    *,
    dp_group: dist.ProcessGroup | None = None,
    attention_backend: str = "dense",
    chunk_rows: int | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """`parallel.step.score` for a PipelinedCausalLM: `[S]` float64 log-probs of every microbatch (forward-only
    schedule), returned on every pp rank."""
    mbs = _packed(model, microbatches, dp_group)
    scored: list[torch.Tensor] = []

    def sink(outputs: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        scored.append(outputs[0].to(torch.float64).cpu())
        return outputs[0].new_zeros(())

    _run(model, mbs, sink, train=False, attention_backend=attention_backend, chunk_rows=chunk_rows,
         temperature=temperature, entropy=False)
    return [lp.to(model.device) for lp in _from_last_stage(model, scored or None)]


def pipeline_clip_grad_norm_(model: PipelinedCausalLM, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`parallel.clip_grad_norm_` over all stages: the norm of this rank's stages (over its meshes) is combined over
    the pp group before scaling; returns the global norm (equal on every rank)."""
    local = clip_grad_norm_(model, float("inf"), norm_type)  # max_norm = inf: the norm only, gradients unchanged
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=model.pp_group)
        total = local
    else:
        powered = local ** norm_type
        dist.all_reduce(powered, group=model.pp_group)
        total = powered ** (1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total
