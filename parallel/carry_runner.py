"""`CarryRunner`: the step runner (`parallel.runner.StepRunner`) of prefix carry (issue #17): it runs a replica's
carry microbatches (`models.carry_microbatch.CarryStep`) event by event, in the planner's order.

Legend: S scored positions of a microbatch.

A forward event runs `model(context, ...)` under the microbatch's `models.tree.carry_exchange.CarryContext` (the tree
forward entered as a module, as in `PlainRunner`, so a parallelized model's units see it), then the loss callback,
and keeps the loss and the exports (`models.tree.carry_exchange.CarryExchange`); a backward event runs the microbatch's
backward with the gradients its consumers sent to its exports. The same `MicrobatchLoss` and `StepMetrics` as
`PlainRunner`; the step's gradient is the sum over its microbatches, as there.

Under data parallelism every replica runs the same kinds of events in the same order (the planner's events), so
FSDP2's gathers and reduce-scatters and EP's all-to-alls line up; an empty event (slot -1) runs the step's null
microbatch with a zero loss (its forward and backward issue the same collectives). In one process empty events run
nothing.

Memory: a microbatch stays open (its graph alive) from its forward to its backward. Of the microbatches that stay
open while later forwards run, the first `resident` keep their saved activations on the device; the others' wait in
pinned host memory (`parallel.host_offload`), so a step's peak holds the saved activations of at most `resident`
open microbatches besides the running one, however many the plan keeps open (exports and the gradients sent to them
stay on the device).

It runs a duplicate plan's microbatches (a list of `models.microbatch.Microbatch`) as `PlainRunner` does, so a
trainer holds one runner whatever `planner.mode` made the step.
"""

from __future__ import annotations

import contextlib
import hashlib
import time

import torch
import torch.distributed as dist

from models.carry_microbatch import CarryMicrobatch, CarryStep
from models.tree.carry_exchange import CarryExchange
from parallel.host_offload import host_offload, offloaded_forwards
from parallel.plain_runner import PlainRunner
from parallel.runner import MicrobatchLoss, StepMetrics, StepSums

__all__ = ["CarryRunner"]


class CarryRunner(PlainRunner):
    """Runs carry steps on a plain or parallelized HybridForCausalLM (arguments as `PlainRunner`, and `resident`:
    how many open microbatches keep their saved activations on the device, see the module docstring)."""

    def __init__(self, model, *, resident: int = 1, **kwargs) -> None:
        super().__init__(model, **kwargs)
        if resident < 0:
            raise ValueError(f"`resident` must be >= 0, got {resident}")
        self.resident = resident

    def _check_events(self, step: CarryStep) -> None:
        """Every replica has the same kinds of events in the same order (else a collective would hang)."""
        if self.dp_group is None:
            return
        kinds = "".join(kind[0] for kind, _ in step.events).encode()
        signature = [len(kinds), int.from_bytes(hashlib.sha256(kinds).digest()[:7], "little")]
        both = torch.tensor(signature + [-x for x in signature], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.dp_group)
        if not torch.equal(both[:2], -both[2:]):
            raise ValueError(
                "DP replicas got different sequences of forward and backward events: every replica must run the same "
                "kinds in the same order (pad with empty events, slot -1)"
            )

    def _null_forward(self, step: CarryStep, temperature: float) -> torch.Tensor:
        """The forward of an empty event: the null microbatch under a context of its own, a zero loss."""
        null: CarryMicrobatch = step.null
        ctx = CarryExchange([null.links]).context(0, null.layout, self.attention_backend)
        return 0.0 * self.model(ctx, chunk_rows=self.chunk_rows, temperature=temperature).logprobs.sum()

    def _empty_event(self, kind: str, step: CarryStep, pending: list[torch.Tensor], temperature: float) -> None:
        """An empty event under data parallelism: a null forward (its zero loss kept), or the backward of the oldest
        kept one (of a fresh one if none is kept)."""
        if kind == "forward":
            pending.append(self._null_forward(step, temperature))
        else:
            (pending.pop(0) if pending else self._null_forward(step, temperature)).backward()

    def train_step(self, microbatches: CarryStep, loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
                   entropy: bool = False) -> StepMetrics:
        """Forward and backward of the step's microbatches in the order of `microbatches.events` (a list of
        microbatches: `PlainRunner.train_step`)."""
        if not isinstance(microbatches, CarryStep):
            return super().train_step(microbatches, loss_fn, temperature=temperature, entropy=entropy)
        step = microbatches
        self._check_events(step)
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
                    output = self.model(ctx, chunk_rows=self.chunk_rows, entropy=entropy, temperature=temperature)
                    loss, metrics = loss_fn(output.logprobs, mb, output)
                exchange.keep(slot, ctx, loss)
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
    def score(self, microbatches: CarryStep, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """`[S]` float64 log-probs of every microbatch (slot order): the forward events in order, without a graph (a
        list of microbatches: `PlainRunner.score`)."""
        if not isinstance(microbatches, CarryStep):
            return super().score(microbatches, temperature=temperature)
        step = microbatches
        self._check_events(step)
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
            out[slot] = self.model(ctx, chunk_rows=self.chunk_rows, temperature=temperature).logprobs.to(torch.float64)
            exchange.keep(slot, ctx, None)
        return [out[slot] for slot in range(len(step))]
