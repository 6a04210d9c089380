"""`PlainRunner`: the step runner (`parallel.runner.StepRunner`) of a whole model on this rank: one process, or a
model wrapped by `parallel.parallelize_hybrid` (TP / EP / FSDP2; the wrapping is transparent to the loop).

Legend: S semantic positions of a microbatch, E experts.

Per microbatch in slot order: `model(layout, ...)` (the tree forward entered as a module, so FSDP2's root unit sees
it) -> the loss callback -> backward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from models.decoder import DecoderLayer, HybridForCausalLM
from models.microbatch import Microbatch
from models.tree.attention import Backend
from parallel.grad_norm import clip_grad_norm_
from parallel.runner import MicrobatchLoss, StepMetrics, StepSums, check_microbatches

__all__ = ["PlainRunner"]


class PlainRunner:
    """Runs microbatches on a plain or parallelized HybridForCausalLM.

    Args:
        model: the model (its parameters are the trained ones).
        dp_group: the data-parallel group (`meshes.dp.get_group()`), used to check that replicas run equally many
            microbatches; None for a single process.
        attention_backend: tree full-attention backend ("dense", "flex", "branch"; see models.tree.attention).
        chunk_rows: rows per vocabulary chunk of the log-probs (`models.logprobs.compact_logprobs`; default: ~512 MiB
            of fp32 scratch, at most 4,096 rows).
    """

    def __init__(self, model: HybridForCausalLM, *, dp_group: dist.ProcessGroup | None = None,
                 attention_backend: Backend = "dense", chunk_rows: int | None = None) -> None:
        self.model = model
        self.dp_group = dp_group
        self.attention_backend = attention_backend
        self.chunk_rows = chunk_rows

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, mb: Microbatch, temperature: float, entropy: bool = False):
        return self.model(mb.layout, self.attention_backend, chunk_rows=self.chunk_rows, entropy=entropy,
                          temperature=temperature)

    def train_step(self, microbatches: Sequence[Microbatch], loss_fn: MicrobatchLoss, *, temperature: float = 1.0,
                   entropy: bool = False) -> StepMetrics:
        """See `parallel.runner.StepRunner.train_step`."""
        check_microbatches(microbatches, self.dp_group, self.device)
        sums = StepSums()
        for slot, mb in enumerate(microbatches):
            start = time.perf_counter()
            output = self._forward(mb, temperature, entropy)
            loss, metrics = loss_fn(output.logprobs, mb, output)
            middle = time.perf_counter()
            loss.backward()
            sums.forward_seconds += middle - start
            sums.backward_seconds += time.perf_counter() - middle
            sums.add(slot, loss, metrics, output)
        return sums.result(microbatches)

    @torch.no_grad()
    def score(self, microbatches: Sequence[Microbatch], *, temperature: float = 1.0) -> list[torch.Tensor]:
        """See `parallel.runner.StepRunner.score`."""
        check_microbatches(microbatches, self.dp_group, self.device)
        return [self._forward(mb, temperature).logprobs.to(torch.float64) for mb in microbatches]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """See `parallel.grad_norm.clip_grad_norm_` (every mesh of a parallelized model)."""
        return clip_grad_norm_(self.model, max_norm, norm_type)

    def decoder_layers(self) -> dict[int, DecoderLayer]:
        return dict(enumerate(self.model.model.layers))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
