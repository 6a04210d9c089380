"""`PipelineRunner`: the step runner (`parallel.runner.StepRunner`) of this rank's pipeline stages
(`parallel.pipeline.PipelinedCausalLM`, torch >= 2.14), through the schedules of `torch.distributed.pipelining`.

Legend: C compact rows of a microbatch, Cm the largest C of the step on this replica, S semantic positions.

Per-microbatch inputs: every pp rank of a replica holds the replica's step prepared (`parallel.replica.prepare_step`:
the planner is deterministic, so all ranks hold the same one); the schedule gets its microbatches as per-microbatch
lists, `arg_mbs` (the first stage's token ids) and `kwarg_mbs` (the TreeContext and log-prob options, given to every
stage). The loss callback runs on the last stage. The schedule orders the forwards and backwards, so a step whose
microbatches carry context (prefix carry: its own event order, carried rows between microbatches) is refused.

Varying C (measured on torch 2.14.1, gloo): a stage's receive buffers are allocated once per schedule from one
shape, either given (static metadata) or inferred from the first microbatch (dynamic inference, which also runs an
extra forward and backward of it). With inferred shapes a second microbatch of another C aborts gloo ("Received data
size doesn't match expected size"). So stage activations are padded to Cm rows, the stages get static metadata for
Cm, and stages and schedule are rebuilt each step (no communication to build; the schedule's first step exchanges
one small vote per stage boundary).

Loss scaling is that of `parallel.runner`: each microbatch loss is already divided by the step's global normalisers,
gradients are summed over microbatches (`scale_grads=False`: no schedule scaling) and replicas (FSDP2 sum), so they
equal the single-process gradient of the step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from models.decoder import DecoderLayer, TreeLMOutput
from models.microbatch import Microbatch
from models.step import Step
from models.tree.attention import Backend
from models.tree.mixers import TreeContext
from parallel.grad_norm import clip_grad_norm_
from parallel.pipeline import PipelinedCausalLM, unpack_stats
from parallel.runner import MicrobatchLoss, StepMetrics, check_step, step_metrics

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Runs steps through this rank's pipeline stages. Arguments as `parallel.plain_runner.PlainRunner`'s but
    `resident` (nothing stays open between microbatches); `model` is the PipelinedCausalLM. Results (StepMetrics,
    scores, the gradient norm) are the same on every pp rank."""

    def __init__(self, model: PipelinedCausalLM, *, dp_group: dist.ProcessGroup | None = None,
                 attention_backend: Backend = "dense", chunk_rows: int | None = None) -> None:
        self.model = model
        self.dp_group = dp_group
        self.attention_backend = attention_backend
        self.chunk_rows = chunk_rows

    def _schedule(self, rows: int, n_microbatches: int, entropy: bool, sink):
        """Stages with static metadata for `rows` padded rows, and the configured schedule; `sink(outputs, index)`
        is its loss function (called on the last stage with each microbatch's outputs and index)."""
        model = self.model
        stages = []
        for part, s in zip(model.parts, model.stage_indices):
            inputs, outputs = model.stage_metadata(s, rows, entropy)
            stages.append(PipelineStage(part, s, model.num_stages, model.device, input_args=inputs,
                                        output_args=outputs, group=model.pp_group))
        cls = get_schedule_class(model.parallel.pp_schedule)
        if issubclass(cls, PipelineScheduleMulti):
            return cls(stages, n_microbatches=n_microbatches, loss_fn=sink, scale_grads=False)
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=sink, scale_grads=False)

    def _check(self, step: Step) -> None:
        """The checks of `parallel.runner.check_step`, and a step that carries nothing between microbatches."""
        if step.carries:
            raise NotImplementedError(
                "the step's microbatches carry context (prefix carry), which pipeline stages do not: the schedule "
                "orders forwards and backwards itself; plan the step with planner.mode = 'duplicate' or 'auto' "
                "(under pipeline parallelism 'auto' plans as 'duplicate')"
            )
        check_step(step, self.dp_group, self.model.device)

    def _run(self, microbatches: Sequence[Microbatch], sink, *, train: bool, temperature: float,
             entropy: bool) -> float:
        """One pass of the schedule over the microbatches (forward and backward if `train`, else forward only);
        returns the host seconds this rank spent in stage forwards."""
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}")
        if self.model.parallel.pp_schedule == "1F1B" and len(microbatches) < self.model.num_stages:
            raise ValueError(
                f"{len(microbatches)} microbatches on this replica but the 1F1B schedule needs at least "
                f"`parallel.pp` = {self.model.num_stages}: plan more microbatches (smaller planner capacity) or set "
                "`parallel.pp_schedule` = 'Interleaved1F1B'"
            )
        rows = max(mb.num_compact for mb in microbatches)
        n = len(microbatches)
        schedule = self._schedule(rows, n, entropy, sink)
        tokens = [(F.pad(mb.layout.tokens, (0, rows - mb.layout.tokens.shape[0])),) for mb in microbatches]
        contexts = [{"ctx": TreeContext(mb.layout, self.attention_backend), "chunk_rows": self.chunk_rows,
                     "temperature": temperature, "entropy": entropy} for mb in microbatches]
        forward_seconds = [0.0]
        started: list[float] = []

        def before(module, args, kwargs):
            started.append(time.perf_counter())

        def after(module, args, kwargs, output):
            forward_seconds[0] += time.perf_counter() - started.pop()

        handles = [h for part in self.model.parts for h in (part.register_forward_pre_hook(before, with_kwargs=True),
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

    def _tree_output(self, outputs: tuple[torch.Tensor, ...], entropy: bool) -> TreeLMOutput:
        """The last stage's outputs as the TreeLMOutput that the loss is handed."""
        logprobs_S, hidden_CD, *rest = outputs
        entropy_S = rest.pop(0) if entropy else None
        stats = iter(unpack_stats(rest[0] if rest else None, self.model.parts[-1].num_experts))
        moe_stats = [next(stats) if t == "moe" else None for t in self.model.config.ffn_types]
        return TreeLMOutput(hidden_CD, moe_stats, logprobs_S, entropy_S)

    def _from_last_stage(self, value):
        """`value` of the last stage's rank (CPU tensors / Python objects), on every rank of the pp group."""
        model = self.model
        box = [value if dist.get_rank(model.pp_group) == model.last_stage_rank else None]
        dist.broadcast_object_list(box, group=model.pp_group, group_src=model.last_stage_rank)
        return box[0]

    def train_step(self, step: Step, loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
                   entropy: bool = False) -> StepMetrics:
        """See `parallel.runner.StepRunner.train_step`. `forward_seconds`: this rank's stage forwards and losses;
        `backward_seconds`: the rest of the schedule (backward, recomputation, waiting for neighbouring stages)."""
        model = self.model
        self._check(step)
        microbatches = step.microbatches
        results: list[tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]] = []
        loss_seconds = [0.0]

        def sink(outputs: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
            start = time.perf_counter()
            output = self._tree_output(outputs, entropy)
            loss, metrics = loss_fn(output.logprobs, microbatches[index], output)
            results.append((loss.detach().to(torch.float64), {k: v.detach() for k, v in metrics.items()},
                            [s.expert_counts for s in output.moe_stats if s is not None]))
            loss_seconds[0] += time.perf_counter() - start
            return loss

        start = time.perf_counter()
        forward_seconds = self._run(microbatches, sink, train=True, temperature=temperature,
                                    entropy=entropy) + loss_seconds[0]
        total_seconds = time.perf_counter() - start
        summary = None
        if results:
            extras: dict[str, float] = {}
            for _, metrics, _ in results:
                for k, v in metrics.items():
                    extras[k] = extras.get(k, 0.0) + float(v.to(torch.float64))
            counts = [torch.stack(c).sum(0).cpu() for c in zip(*(r[2] for r in results))]
            summary = (torch.stack([r[0] for r in results]).cpu(), extras, counts)
        losses_K, extras, counts = self._from_last_stage(summary)
        it = iter(c.to(model.device) for c in counts)
        return step_metrics(
            microbatches, losses_K, extras, [next(it) if t == "moe" else None for t in model.config.ffn_types],
            forward_seconds, total_seconds - forward_seconds,
        )

    @torch.no_grad()
    def score(self, step: Step, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """See `parallel.runner.StepRunner.score` (forward-only schedule; returned on every pp rank)."""
        self._check(step)
        microbatches = step.microbatches
        scored: list[torch.Tensor] = []

        def sink(outputs: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
            scored.append(outputs[0].to(torch.float64).cpu())
            return outputs[0].new_zeros(())

        self._run(microbatches, sink, train=False, temperature=temperature, entropy=False)
        return [lp.to(self.model.device) for lp in self._from_last_stage(scored or None)]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`parallel.grad_norm.clip_grad_norm_` over all stages: the norm of this rank's stages (over its meshes) is
        combined over the pp group before scaling; returns the global norm (equal on every rank)."""
        model = self.model
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

    def decoder_layers(self) -> dict[int, DecoderLayer]:
        return {int(i): layer for i, layer in self.model.model.layers.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Each rank gathers its stages' tensors from the FSDP2 shards, and the ranks of rank 0's pp group send
        theirs to it (on the CPU)."""
        stages = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        group = self.model.pp_group
        if 0 not in dist.get_process_group_ranks(group):
            return {}
        main = dist.get_rank() == 0
        parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size(group))] if main else None
        dist.gather_object({k: v.cpu() for k, v in stages.items()}, parts, dst=0, group=group)
        return {k: v for part in parts for k, v in part.items()} if main else {}
