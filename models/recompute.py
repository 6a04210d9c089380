"""Activation recomputation of decoder layers: which part of a layer backward recomputes, and which op outputs it
keeps (torchtitan's full and selective activation checkpointing, chosen per layer kind).

A layer is two residual blocks: the mixer block (input norm, token mixer) and the FFN block (post-attention norm
with the mixer's residual add, MLP or MoE, the second residual add). A recomputed part runs under torch's
non-reentrant checkpoint from its inputs, inside the layer's call (so inside its FSDP2 unit) and from the same flat
or tree context. With op groups to save, an op-level policy (`torch.utils.checkpoint.
create_selective_checkpoint_contexts`) keeps the outputs of those ATen ops from the forward and recomputes the rest.

The policy sees ATen ops only. Kernels launched from inside an autograd Function (fla's KDA/GDN Triton kernels, the
fused row-wise kernels of `models.ops`) are not ATen ops: they run again in the recomputation, on the recomputed
inputs, and their outputs are never taken from the cache; only the tensors they allocate through ATen (`empty`) are
ops the policy sees, and no group saves those (a kernel writes into them without bumping their version counter,
so a cached allocation could hand back stale or overwritten data unnoticed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.config import LayerType, ModelConfig

__all__ = ["LayerRecompute", "SAVE_GROUPS", "SelectiveRecompute", "save_ops"]

Part = Literal["layer", "mixer", "ffn"]
SaveGroup = Literal["attention", "experts", "mm"]


def _ops(*names: str) -> tuple:
    """The ops `names` ("namespace.op.overload" under torch.ops, or "hop.<name>" for a higher-order op) that this
    torch registers."""
    found = []
    for name in names:
        root, path = (torch._higher_order_ops, name[4:]) if name.startswith("hop.") else (torch.ops, name)
        try:
            found.append(functools.reduce(getattr, path.split("."), root))
        except (AttributeError, RuntimeError):
            continue
    return tuple(found)


SAVE_GROUPS: dict[str, Callable[[], tuple]] = {
    # Softmax attention kernels: output and log-sum-exp (torch's varlen flash custom op of flat attention, the aten
    # flash kernel the tree's branch views call, the SDPA / cuDNN / flex kernels other backends call).
    "attention": lambda: _ops(
        "torch_attn._varlen_attn.default", "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default", "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
        "aten._cudnn_attention_forward.default", "hop.flex_attention",
    ),
    # Routed experts: the grouped GEMMs of the CUDA path and the router's top-k choice (which also keeps the
    # recomputed routing identical to the forward's).
    "experts": lambda: _ops("aten._grouped_mm.default", "aten.topk.default"),
    # Every other GEMM: projections, shared experts, and the plain-torch references' attention and expert matmuls.
    "mm": lambda: _ops("aten.mm.default", "aten.addmm.default", "aten.bmm.default"),
}


@functools.cache
def save_ops(groups: tuple[str, ...]) -> frozenset:
    """The ops whose outputs a policy saving `groups` (keys of SAVE_GROUPS) keeps."""
    return frozenset(op for g in groups for op in SAVE_GROUPS[g]())


def _policy(saved: frozenset):
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@dataclass(frozen=True)
class LayerRecompute:
    """What one layer recomputes in backward: `part` ("layer": both blocks from the layer input; "mixer" / "ffn":
    that block only), keeping the outputs of the ops of `save` (SAVE_GROUPS keys; none: recompute everything)."""

    part: Part = "layer"
    save: tuple[SaveGroup, ...] = ()

    def run(self, fn: Callable, *args):
        """`fn(*args)`, its activations recomputed in backward (when grad is enabled)."""
        if not self.save:
            return checkpoint(fn, *args, use_reentrant=False)
        policy = _policy(save_ops(tuple(self.save)))
        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))


@dataclass(kw_only=True)
class SelectiveRecompute:
    """Selective recomputation: which layers recompute which part, keeping which op outputs (`[parallel.selective]`
    of a job config; `HybridForCausalLM.set_activation_checkpointing` applies it).

    The trade, per decoder layer of T rows: no recomputation keeps every activation of both blocks; full
    recomputation keeps one `[T, D]` layer input and runs the layer's forward twice. The MoE FFN block holds most of
    a MoE layer's activations (the k routed copies of every row, their gate|up and SwiGLU outputs, the expert
    outputs before the combine: each k times a row's width or more) for a small share of its time, so part "ffn"
    frees most of the memory for little compute. The full-attention kernel is the costliest op to repeat (flash
    attention: 31% of a flat ling-3-tiny step on the H200), and its output and log-sum-exp are one row's width:
    "attention" in `save`, or only "linear_attention" in `layers`, removes the largest recompute cost for little
    memory. Measure with `python -m bench.speed --recompute ...` (seconds and peak GiB per option).
    """

    layers: tuple[LayerType, ...] = ("linear_attention", "full_attention")
    """Layer kinds (by token mixer) that recompute: "linear_attention" (KDA / GDN layers), "full_attention" (MLA /
    gated-attention layers). The other layers keep every activation."""
    part: Part = "layer"
    """What a recomputing layer recomputes: "layer" (both blocks, from the layer input: least memory), "mixer" (the
    input norm and token mixer; the FFN block keeps its activations), "ffn" (the post-attention norm and MLP/MoE; the
    mixer block keeps its activations)."""
    every: int = 1
    """Only every N-th layer recomputes (layers N-1, 2N-1, ... counted from 0, torchtitan's integer option), of the
    kinds in `layers`: about 1/N of the recompute cost for 1/N of the memory saving."""
    save: tuple[SaveGroup, ...] = ("attention", "experts")
    """Op outputs kept from the forward inside the recomputed part, by group: "attention" (softmax-attention kernel
    output and log-sum-exp), "experts" (routed-expert grouped GEMMs and the router's top-k), "mm" (every other GEMM:
    projections, shared experts; also the plain-torch references' matmuls). Everything else (norms, SwiGLU, gates,
    MoE permute/combine, casts, linear-attention kernels) is recomputed. Empty: recompute the whole part."""

    def __post_init__(self) -> None:
        self.layers, self.save = tuple(self.layers), tuple(self.save)
        for kind in self.layers:
            if kind not in ("linear_attention", "full_attention"):
                raise ValueError(f"`layers` entries must be 'linear_attention' or 'full_attention', got {kind!r}")
        if self.part not in ("layer", "mixer", "ffn"):
            raise ValueError(f"`part` must be 'layer', 'mixer' or 'ffn', got {self.part!r}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"`every` must be an integer >= 1, got {self.every!r}")
        for group in self.save:
            if group not in SAVE_GROUPS:
                raise ValueError(f"`save` entries must be among {', '.join(map(repr, SAVE_GROUPS))}, got {group!r}")
        if not self.layers:
            raise ValueError("`layers` is empty, so nothing would be recomputed: name a layer kind, or set "
                             "`parallel.activation_checkpointing` = 'none'")

    def per_layer(self, config: ModelConfig) -> list[LayerRecompute | None]:
        """Per layer of `config`: its LayerRecompute, or None where it keeps every activation."""
        choice = LayerRecompute(self.part, self.save)
        return [choice if kind in self.layers and (i + 1) % self.every == 0 else None
                for i, kind in enumerate(config.layer_types)]
