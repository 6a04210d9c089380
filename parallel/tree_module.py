"""Tree execution through module calls, so that wrappers which hook `forward` (FSDP2) see every layer.

Legend: C compact rows, D model dim, S semantic positions.

`models.tree.execute.tree_logprobs` drives a model by calling each layer's steps directly; FSDP2 gathers a unit's
parameters in a forward pre-hook and registers its gradient reduction in a post-hook, so an FSDP unit must be
entered through `module(...)`. `to_tree_modules` therefore gives the decoder layers and the model subclasses
(class swap, as `fully_shard` does) whose `forward` also accepts a `TreeLayout`:
  layer(x_CD, layout, backend) -> (x_CD, MoEStats | None)       one layer of `models.tree.execute`, with activation
                                                                recomputation inside the unit
  model(layout, backend, chunk_rows) -> (logprobs_S, DecoderOutput)   the whole model + compact log-probs
Flat inputs keep the models' own forward. Under tensor parallelism the log-probs are vocabulary-parallel.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

from models.decoder import DecoderLayer, DecoderOutput, HybridForCausalLM
from models.logprobs import compact_logprobs
from models.moe import MoEStats
from models.tree.execute import _tree_layer, tree_logprobs
from models.tree.layout import TreeLayout
from parallel.collectives import copy_to_group
from parallel.vocab_parallel import vocab_parallel_compact_logprobs

__all__ = ["TreeDecoderLayer", "TreeCausalLM", "to_tree_modules", "forward_tree"]

# FSDP2 registers its pre-backward hook on the tensors of a unit's output that it finds by pytree traversal; the
# router statistics carry gradients (aux losses) that reach a layer before its hidden-state gradient does, so the
# hook must see them too.
pytree.register_dataclass(MoEStats)


class TreeDecoderLayer(DecoderLayer):
    def forward(self, x, ctx, attention_backend="dense"):
        """x `[C, D]` and a TreeLayout -> one layer of tree execution; a flat context -> `DecoderLayer.forward`."""
        if not isinstance(ctx, TreeLayout):
            return super().forward(x, ctx)
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(_tree_layer, self, x, ctx, attention_backend, use_reentrant=False)
        return _tree_layer(self, x, ctx, attention_backend)


class TreeCausalLM(HybridForCausalLM):
    def forward(self, input_ids, *args, **kwargs):
        """A TreeLayout (+ attention_backend, chunk_rows) -> (logprobs `[S]`, DecoderOutput); token ids ->
        `HybridForCausalLM.forward`."""
        if isinstance(input_ids, TreeLayout):
            return self.tree_forward(input_ids, *args, **kwargs)
        return super().forward(input_ids, *args, **kwargs)

    def tree_forward(self, layout: TreeLayout, attention_backend: str = "dense", chunk_rows: int | None = None):
        linear = self.config.linear_attention
        if linear is not None and linear.chunk_size != layout.chunk_size:
            raise ValueError(
                f"the plan was made with chunk_size {layout.chunk_size} but the model's linear attention uses "
                f"{linear.chunk_size}: plan with planner.calls.plan_calls(batch, chunk_size={linear.chunk_size})"
            )
        x_CD = self.model.embed_tokens(layout.tokens)
        stats: list[MoEStats | None] = []
        for layer in self.model.layers:
            x_CD, s = layer(x_CD, layout, attention_backend)
            stats.append(s)
        hidden_CD = self.model.norm(x_CD)
        tp_group = getattr(self.model.embed_tokens, "tp_group", None)
        if tp_group is None:
            logprobs = compact_logprobs(hidden_CD, self.lm_head_weight, layout.logit_row, layout.target,
                                        chunk_rows=chunk_rows)
        else:
            weight_VD = self.lm_head_weight
            logprobs = vocab_parallel_compact_logprobs(
                copy_to_group(hidden_CD, tp_group), weight_VD, layout.logit_row, layout.target,
                vocab_start=self.model.embed_tokens.tp_group_rank * weight_VD.shape[0], group=tp_group,
                chunk_rows=chunk_rows,
            )
        return logprobs, DecoderOutput(hidden_CD, stats)


def to_tree_modules(model: HybridForCausalLM) -> None:
    """Swap the classes of `model` and its decoder layers (in place) for the tree-aware module calls above."""
    for layer in model.model.layers:
        layer.__class__ = TreeDecoderLayer
    model.__class__ = TreeCausalLM


def forward_tree(model: HybridForCausalLM, layout: TreeLayout, attention_backend: str = "dense",
                 chunk_rows: int | None = None) -> tuple[torch.Tensor, DecoderOutput]:
    """(logprobs `[S]`, DecoderOutput) of one microbatch, for a parallelized (`TreeCausalLM`) or a plain model."""
    if isinstance(model, TreeCausalLM):
        return model(layout, attention_backend, chunk_rows)
    return tree_logprobs(model, layout, attention_backend, chunk_rows=chunk_rows)
