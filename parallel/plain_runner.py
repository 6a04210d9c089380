"""`PlainRunner`: the step runner (`parallel.runner.StepRunner`) of a whole model on this rank: one process, or a
model wrapped by `parallel.parallelize_hybrid` (TP / EP / FSDP2; the wrapping is transparent to the loop), for
steps of every planner mode.

Legend: S scored positions of a microbatch.

It runs a `models.step.Step` event by event, in the step's order. A forward event runs `model(ctx, ...)` (the tree
forward entered as a module, so FSDP2's root unit sees it) under the microbatch's context, then the loss callback,
and keeps the loss; a backward event runs that microbatch's backward. The contexts and what crosses microbatches are
`models.tree.carry_exchange.CarryExchange`'s: a HARTS microbatch (no links) runs under a plain `TreeContext`, and
its events are its forward and right after it its backward; a carry microbatch runs under a `CarryContext`
that reads what earlier microbatches exported, and its backward injects the gradients its consumers sent to its
exports. The step's gradient is the sum over its microbatches either way.

Under data parallelism every replica runs the same kinds of events in the same order (`parallel.runner.check_step`),
so FSDP2's gathers and reduce-scatters and EP's all-to-alls line up; an empty event (slot -1, carry steps) runs the
step's null microbatch with a zero loss (its forward and backward issue the same collectives). In one process empty
events run nothing.

Memory: a microbatch stays open (its graph alive) from its forward to its backward. Of the microbatches that stay
open while later forwards run (carry steps), the first `resident` keep their saved activations on the device; the
others' wait in pinned host memory (`parallel.host_offload`), so a step's peak holds the saved activations of at
most `resident` open microbatches besides the running one, however many the plan keeps open (exports and the
gradients sent to them stay on the device).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from models.decoder import DecoderLayer, HybridForCausalLM, TreeLMOutput
from models.step import Step
from models.tree.attention import Backend
from models.tree.carry_exchange import CarryExchange
from models.tree.mixers import TreeContext
from parallel.grad_norm import clip_grad_norm_
from parallel.host_offload import host_offload, offloaded_forwards
from parallel.runner import MicrobatchLoss, StepMetrics, StepSums, check_step

__all__ = ["PlainRunner"]


class PlainRunner:
    """Runs steps on a plain or parallelized HybridForCausalLM.

    Args:
        model: the model (its parameters are the trained ones).
        dp_group: the data-parallel group (`meshes.dp.get_group()`), used to check that replicas run the same
            events and to run empty events; None for a single process.
        attention_backend: tree full-attention backend ("dense", "flex", "branch"; see models.tree.attention).
        chunk_rows: rows per vocabulary chunk of the log-probs (`models.logprobs.compact_logprobs`; default: ~512 MiB
            of fp32 scratch, at most 4,096 rows).
        resident: how many open carry microbatches keep their saved activations on the device (see the module
            docstring).
    """

    def __init__(self, model: HybridForCausalLM, *, dp_group: dist.ProcessGroup | None = None,
                 attention_backend: Backend = "dense", chunk_rows: int | None = None, resident: int = 1) -> None:
        if resident < 0:
            raise ValueError(f"`resident` must be >= 0, got {resident}")
        self.model = model
        self.dp_group = dp_group
        self.attention_backend = attention_backend
        self.chunk_rows = chunk_rows
        self.resident = resident

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, ctx: TreeContext, temperature: float, entropy: bool = False) -> TreeLMOutput:
        return self.model(ctx, chunk_rows=self.chunk_rows, entropy=entropy, temperature=temperature)

    def _null_forward(self, step: Step, temperature: float) -> torch.Tensor:
        """The forward of an empty event: the null microbatch under a context of its own, a zero loss."""
        ctx = CarryExchange([step.null.links]).context(0, step.null.layout, self.attention_backend)
        return 0.0 * self._forward(ctx, temperature).logprobs.sum()

    def _empty_event(self, kind: str, step: Step, pending: list[torch.Tensor], temperature: float) -> None:
        """An empty event under data parallelism: a null forward (its zero loss kept), or the backward of the oldest
        kept one (of a fresh one if none is kept)."""
        if kind == "forward":
            pending.append(self._null_forward(step, temperature))
        else:
            (pending.pop(0) if pending else self._null_forward(step, temperature)).backward()

    def train_step(self, step: Step, loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
                   entropy: bool = False) -> StepMetrics:
        """See `parallel.runner.StepRunner.train_step`: the forwards and backwards in the order of `step.events`."""
        check_step(step, self.dp_group, self.device)
        exchange = CarryExchange([mb.links for mb in step])
        sums = StepSums()
        nulls: list[torch.Tensor] = []
        offloaded = offloaded_forwards(step.events, self.resident)
        for kind, slot in step.events:
            start = time.perf_counter()
            if slot < 0:
                if self.dp_group is not None:
                    self._empty_event(kind, step, nulls, temperature)
            elif kind == "forward":
                mb = step[slot]
                ctx = exchange.context(slot, mb.layout, self.attention_backend)
                with host_offload() if slot in offloaded else contextlib.nullcontext():
                    output = self._forward(ctx, temperature, entropy)
                    loss, metrics = loss_fn(output.logprobs, mb, output)
                exchange.keep(slot, loss)
                sums.add(slot, loss, metrics, output)
            else:
                exchange.backward(slot)
            elapsed = time.perf_counter() - start
            if kind == "forward":
                sums.forward_seconds += elapsed
            else:
                sums.backward_seconds += elapsed
        exchange.check_finished()
        return sums.result(step.microbatches)

    @torch.no_grad()
    def score(self, step: Step, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """See `parallel.runner.StepRunner.score`: the forward events in order, without a graph."""
        check_step(step, self.dp_group, self.device)
        exchange = CarryExchange([mb.links for mb in step])
        out: dict[int, torch.Tensor] = {}
        for kind, slot in step.events:
            if kind != "forward":
                continue
            if slot < 0:
                if self.dp_group is not None:
                    self._null_forward(step, temperature)
                continue
            ctx = exchange.context(slot, step[slot].layout, self.attention_backend)
            out[slot] = self._forward(ctx, temperature).logprobs.to(torch.float64)
            exchange.keep(slot, None)
        return [out[slot] for slot in range(len(step))]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """See `parallel.grad_norm.clip_grad_norm_` (every mesh of a parallelized model)."""
        return clip_grad_norm_(self.model, max_norm, norm_type)

    def decoder_layers(self) -> dict[int, DecoderLayer]:
        return dict(enumerate(self.model.model.layers))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
