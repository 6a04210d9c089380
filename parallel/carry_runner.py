"""`CarryRunner`: the step runner (`parallel.runner.StepRunner`) of prefix carry (issue #17): it runs a replica's
carry microbatches (`models.carry_microbatch.CarryStep`) event by event, in the planner's order.

Legend: S scored positions of a microbatch.

A forward event runs `model(context, ...)` under the microbatch's `models.tree.carry.CarryContext` (the tree
forward entered as a module, as in `PlainRunner`), then the loss callback, and keeps the loss and the exports
(`models.tree.carry.CarryExchange`); a backward event runs the microbatch's backward with the gradients its
consumers sent to its exports. The same `MicrobatchLoss` and `StepMetrics` as `PlainRunner`; the step's gradient is
the sum over its microbatches, as there. One process only for now: empty events (slot -1) run nothing.
"""

from __future__ import annotations

import time

import torch

from models.carry_microbatch import CarryStep
from models.tree.carry import CarryExchange
from parallel.plain_runner import PlainRunner
from parallel.runner import MicrobatchLoss, StepMetrics, StepSums

__all__ = ["CarryRunner"]


class CarryRunner(PlainRunner):
    """Runs carry steps on a plain HybridForCausalLM (arguments as `PlainRunner`; `dp_group` must be None)."""

    def _require_one_process(self) -> None:
        if self.dp_group is not None:
            raise NotImplementedError(
                "CarryRunner runs one process only so far: use planner.mode = 'duplicate' with data parallelism"
            )

    def train_step(self, microbatches: CarryStep, loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
                   entropy: bool = False) -> StepMetrics:
        """Forward and backward of the step's microbatches in the order of `microbatches.events`."""
        self._require_one_process()
        step = microbatches
        exchange = CarryExchange([mb.links for mb in step])
        sums = StepSums()
        for kind, slot in step.events:
            if slot < 0:
                continue
            mb = step[slot]
            start = time.perf_counter()
            if kind == "forward":
                ctx = exchange.context(slot, mb.layout, self.attention_backend)
                output = self.model(ctx, chunk_rows=self.chunk_rows, entropy=entropy, temperature=temperature)
                loss, metrics = loss_fn(output.logprobs, mb, output)
                exchange.keep(slot, ctx, loss)
                sums.add(slot, loss, metrics, output)
                sums.forward_seconds += time.perf_counter() - start
            else:
                exchange.backward(slot)
                sums.backward_seconds += time.perf_counter() - start
        exchange.check_finished()
        return sums.result(step.microbatches)

    @torch.no_grad()
    def score(self, microbatches: CarryStep, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """`[S]` float64 log-probs of every microbatch (slot order), forwards only, in the events' order."""
        self._require_one_process()
        step = microbatches
        exchange = CarryExchange([mb.links for mb in step])
        out: dict[int, torch.Tensor] = {}
        for kind, slot in step.events:
            if kind != "forward" or slot < 0:
                continue
            ctx = exchange.context(slot, step[slot].layout, self.attention_backend)
            out[slot] = self.model(ctx, chunk_rows=self.chunk_rows, temperature=temperature).logprobs.to(torch.float64)
            exchange.keep(slot, ctx, None)
        return [out[slot] for slot in range(len(step))]
