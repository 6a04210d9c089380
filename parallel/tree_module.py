"""What tree execution needs under parallelism beyond the model's own module calls.

Legend: C compact rows, D model dim, S semantic positions, Vl LM-head rows of this rank.

FSDP2 gathers a unit's parameters in a forward pre-hook, so every unit must be entered through `module(...)`. The
model already does so: its layer loop calls each decoder layer as a module (activation recomputation inside the
layer), and the step runners call the model itself on a TreeContext (`model(ctx, ...)`: the root unit, embeddings,
final norm, LM head). What remains parallel-specific is here:
- pytree registration of `MoEStats` and `TreeLMOutput`: FSDP2 registers its pre-backward hook on the tensors of a
  unit's output; the router statistics carry gradients (aux losses) that reach a layer before its hidden-state
  gradient does, and the root's output is a TreeLMOutput, so the hook must see their tensors. torch 2.13 walks
  dataclasses itself; earlier releases find the tensors by pytree traversal only;
- `VocabParallelCausalLM`: under tensor parallelism the LM head is sharded over the vocabulary, so the log-probs
  of the tree forward are vocabulary-parallel.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from models.decoder import HybridForCausalLM, TreeLMOutput
from models.moe import MoEStats
from models.tree.layout import TreeLayout
from parallel.collectives import copy_to_group
from parallel.vocab_parallel import vocab_parallel_compact_logprobs

__all__ = ["VocabParallelCausalLM", "use_vocab_parallel_logprobs"]

pytree.register_dataclass(MoEStats)
pytree.register_dataclass(TreeLMOutput)


class VocabParallelCausalLM(HybridForCausalLM):
    """A HybridForCausalLM whose LM head (or tied embedding) is sharded over the vocabulary by
    `parallel.tensor_parallel`: rank r holds rows [r Vl, (r+1) Vl) and the tp group is the embedding's."""

    def compact_logprobs(
        self, hidden_CD: torch.Tensor, layout: TreeLayout, chunk_rows: int | None = None, entropy: bool = False
    ):
        """`HybridForCausalLM.compact_logprobs` with the vocabulary split over the tp group (identical on all
        ranks; the hidden-state gradient is summed over the group)."""
        embed = self.model.embed_tokens
        weight_VD = self.lm_head_weight
        return vocab_parallel_compact_logprobs(
            copy_to_group(hidden_CD, embed.tp_group), weight_VD, layout.logit_row, layout.target,
            vocab_start=embed.tp_group_rank * weight_VD.shape[0], group=embed.tp_group, chunk_rows=chunk_rows,
            entropy=entropy, fused=self.kernels.fused_rowwise,
        )


def use_vocab_parallel_logprobs(model: HybridForCausalLM) -> None:
    """Swap the class of `model` (in place, as `fully_shard` does) for `VocabParallelCausalLM`; call after
    `parallel.tensor_parallel.apply_tensor_parallel` and before FSDP2."""
    if not hasattr(model.model.embed_tokens, "tp_group"):
        raise ValueError("the embeddings are not vocabulary-parallel: apply_tensor_parallel(model, mesh) first")
    model.__class__ = VocabParallelCausalLM
