"""Activation recomputation of decoder layers: which part of a layer backward recomputes, and which op outputs it
keeps (torchtitan's full and selective activation checkpointing, chosen per layer kind).

A layer is two residual blocks: the mixer block (input norm, token mixer) and the FFN block (post-attention norm
with the mixer's residual add, MLP or MoE, the second residual add). A recomputed part runs under torch's
non-reentrant checkpoint from its inputs, inside the layer's call (so inside its FSDP2 unit) and from the same flat
or tree context. With op groups to save, an op-level policy (`torch.utils.checkpoint.
create_selective_checkpoint_contexts`) keeps the outputs of those ATen ops from the forward and recomputes the rest.

The policy sees every ATen op and torch custom op that runs eagerly, also inside an autograd Function's forward (the
attention forwards of `models.ops.varlen_attention` are called there, flash's ATen op and FlashAttention-4's custom
op `arbor::fa4_varlen_forward`: the "attention" group relies on it). It does not see the kernels a Function launches
directly (fla's KDA/GDN Triton kernels, the fused row-wise kernels of
`models.ops`): they run again in the recomputation, on the recomputed inputs. Nor does it see compiled regions
(`torch.compile`: the flex attention of tree execution on CUDA), which are recomputed whole. No group saves a tensor
such a kernel writes into after the op that made it (a kernel's write does not bump the version counter, so a cached
tensor could hand back overwritten data unnoticed; `tests/models/test_recompute.py` checks the saved outputs).

Saved op outputs live in torch's checkpoint storage, not in autograd's saved tensors, so `saved_tensors_hooks`
(`parallel.host_offload`) cannot move them: inside `without_saved_ops()` every part recomputes whole.

Inside a recomputed part, in its forward and in backward's recomputation of it, `in_recomputed_part()` is true.
Checkpointing drops the part's saved tensors in the forward and keeps the recomputed ones from the recomputation,
which runs right before the part's backward, until that backward has run; so an op may save intermediates there
that its backward would otherwise compute again (the KDA cores, `models.ops.kda`) at the cost of one part's memory
at a time, where saving them in a layer that is not recomputed would hold them for every layer. Both passes must
save the same tensors (torch checks their number and shapes), so the flag is on in both.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.config import LayerType, ModelConfig

__all__ = ["LayerRecompute", "SAVE_GROUPS", "SelectiveRecompute", "in_recomputed_part", "parse_recompute_option",
           "save_ops", "without_saved_ops"]

Part = Literal["layer", "mixer", "ffn"]
SaveGroup = Literal["attention", "experts", "mm"]

#: The ops of each `save` group by qualified name (`str(op)`: "namespace.op.overload", a higher-order op's name),
#: matched when the policy sees an op, so an op registered late (by an import) is matched too. Every name is an op of
#: torch 2.13 or one `models.ops` registers (`tests/models/test_recompute.py`).
SAVE_GROUPS: dict[str, frozenset[str]] = {
    # Softmax attention kernels: output and log-sum-exp. Flash and FlashAttention-4 (flat attention and the tree's
    # branch views), eager flex attention (the tree's "flex" backend off CUDA; on CUDA it runs compiled, which the
    # policy does not see).
    "attention": frozenset({"aten._flash_attention_forward.default", "arbor.fa4_varlen_forward.default",
                            "flex_attention"}),
    # Routed experts: the grouped GEMMs of the CUDA path and the router's top-k choice (which also keeps the
    # recomputed routing identical to the forward's).
    "experts": frozenset({"aten._grouped_mm.default", "aten.topk.default"}),
    # All remaining GEMMs: projections, shared experts, the bf16 router's fp32-writing GEMMs (`aten.mm.dtype`), and
    # the plain-torch references' attention and expert matmuls.
    "mm": frozenset({"aten.mm.default", "aten.mm.dtype", "aten.addmm.default", "aten.bmm.default"}),
}

_saving_ops = contextvars.ContextVar("saving_ops", default=True)
_in_part = contextvars.ContextVar("in_recomputed_part", default=False)


def in_recomputed_part() -> bool:
    """Whether the forward now running belongs to a `LayerRecompute` part: its first forward or backward's
    recomputation of it (module docstring)."""
    return _in_part.get()


@contextlib.contextmanager
def _recomputed_part(inner: contextlib.AbstractContextManager | None = None) -> Iterator[None]:
    """One of checkpoint's two contexts (`inner`: the selective policy's one): sets `in_recomputed_part()`."""
    token = _in_part.set(True)
    try:
        with inner or contextlib.nullcontext():
            yield
    finally:
        _in_part.reset(token)


@contextlib.contextmanager
def without_saved_ops() -> Iterator[None]:
    """Inside it, `LayerRecompute.run` keeps no op outputs: a recomputed part keeps only its inputs (through
    autograd's saved tensors, which `saved_tensors_hooks` see) and recomputes everything."""
    token = _saving_ops.set(False)
    try:
        yield
    finally:
        _saving_ops.reset(token)


def save_ops(groups: tuple[str, ...]) -> frozenset[str]:
    """The qualified op names whose outputs a policy saving `groups` (keys of SAVE_GROUPS) keeps."""
    return frozenset(name for g in groups for name in SAVE_GROUPS[g])


@functools.cache
def _policy(groups: tuple[str, ...]):
    saved, decided = save_ops(groups), {}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        save = decided.get(func)
        if save is None:
            save = decided[func] = str(func) in saved
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@dataclass(frozen=True)
class LayerRecompute:
    """What one layer recomputes in backward: `part` ("layer": both blocks from the layer input; "mixer" / "ffn":
    that block only), keeping the outputs of the ops of `save` (SAVE_GROUPS keys; none: recompute everything)."""

    part: Part = "layer"
    save: tuple[SaveGroup, ...] = ()

    def run(self, fn: Callable, *args):
        """`fn(*args)`, its activations recomputed in backward (when grad is enabled), with `in_recomputed_part()`
        true in both passes."""
        if not self.save or not _saving_ops.get():
            return checkpoint(fn, *args, use_reentrant=False,
                              context_fn=lambda: (_recomputed_part(), _recomputed_part()))
        policy = _policy(tuple(self.save))

        def contexts():
            forward, recompute = create_selective_checkpoint_contexts(policy)
            return _recomputed_part(forward), _recomputed_part(recompute)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


@dataclass(kw_only=True)
class SelectiveRecompute:
    """Selective recomputation: which layers recompute which part, keeping which op outputs (`[parallel.selective]`
    of a job config; `HybridForCausalLM.set_activation_checkpointing` applies it).

    The trade, per decoder layer of T rows: no recomputation keeps every activation of both blocks; full
    recomputation keeps one `[T, D]` layer input and runs the layer's forward twice. The MoE FFN block holds most of
    a MoE layer's activations (the k routed copies of every row, their gate|up and SwiGLU outputs, the expert
    outputs before the combine: each k times a row's width or more) for a small share of its time, so part "ffn"
    with the default `save` frees most of that memory for little compute; saving "experts" keeps more than half of
    it again (see `save`). The full-attention kernel is the costliest op to repeat (its share of a flat step:
    bench/RESULTS.md, "GPU: where a step's time goes"), and its output and log-sum-exp are one row's width:
    "attention" in `save`, or only "linear_attention" in `layers`, removes the largest recompute cost for little
    memory. Measure with `python -m bench.speed --recompute ...` (seconds and peak GiB per option; measured options:
    bench/RESULTS.md, "GPU: recomputation options").
    """

    layers: tuple[LayerType, ...] = ("linear_attention", "full_attention")
    """Layer kinds (by token mixer) that recompute: "linear_attention" (KDA / GDN layers), "full_attention" (MLA /
    gated-attention layers). The other layers keep every activation."""
    part: Part = "layer"
    """What a recomputing layer recomputes: "layer" (both blocks, from the layer input: least memory), "mixer" (the
    input norm and token mixer; the FFN block keeps its activations), "ffn" (the post-attention norm and MLP/MoE; the
    mixer block keeps its activations)."""
    every: int = 1
    """Only every N-th layer of the kinds in `layers` recomputes (the N-th, 2N-th, ... of them in model order; with
    both kinds, layers N-1, 2N-1, ... counted from 0, torchtitan's integer option): about 1/N of the recompute cost
    for 1/N of the memory saving. An N that selects no layer of the model is an error."""
    save: tuple[SaveGroup, ...] = ("attention",)
    """Op outputs kept from the forward inside the recomputed part, by group (`SAVE_GROUPS`): "attention"
    (softmax-attention kernel output and log-sum-exp: one row's width per full-attention layer), "experts"
    (routed-expert grouped GEMMs and the router's top-k: k x (2F + D) values per row and MoE layer, the gate|up and
    down outputs of every routed copy; ling-3-tiny 8 x 2,560 bf16 = 41 KB per row, 0.94 MB per row over its 23 MoE
    layers, about 55% of what its routed experts keep without recomputation), "mm" (all remaining GEMMs:
    projections, shared experts; also the plain-torch references' matmuls). Everything else (norms, SwiGLU, gates,
    MoE permute/combine, casts, linear-attention kernels) is recomputed. Empty: recompute the whole part."""

    def __post_init__(self) -> None:
        for name in ("layers", "save"):
            if isinstance(getattr(self, name), str):
                raise ValueError(f"`{name}` must be a list, got the string {getattr(self, name)!r}: write "
                                 f"[{getattr(self, name)!r}]")
        self.layers, self.save = tuple(self.layers), tuple(self.save)
        for kind in self.layers:
            if kind not in ("linear_attention", "full_attention"):
                raise ValueError(f"`layers` entries must be 'linear_attention' or 'full_attention', got {kind!r}")
        if self.part not in ("layer", "mixer", "ffn"):
            raise ValueError(f"`part` must be 'layer', 'mixer' or 'ffn', got {self.part!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"`every` must be an integer >= 1, got {self.every!r}")
        for group in self.save:
            if group not in SAVE_GROUPS:
                raise ValueError(f"`save` entries must be among {', '.join(map(repr, SAVE_GROUPS))}, got {group!r}")
        if not self.layers:
            raise ValueError("`layers` is empty, so nothing would be recomputed: name a layer kind, or set "
                             "`parallel.activation_checkpointing` = 'none'")

    def per_layer(self, config: ModelConfig) -> list[LayerRecompute | None]:
        """Per layer of `config`: its LayerRecompute, or None where it keeps every activation. Raises ValueError
        when no layer recomputes (`every` larger than the model's count of layers of the kinds in `layers`)."""
        choice, count, chosen = LayerRecompute(self.part, self.save), 0, []
        for kind in config.layer_types:
            count += kind in self.layers
            chosen.append(choice if kind in self.layers and count % self.every == 0 else None)
        if not any(chosen):
            raise ValueError(
                f"`every` = {self.every} selects no layer: the model has {count} layer(s) of the kinds in `layers` "
                f"{list(self.layers)}; lower `every`, add a kind to `layers`, or set "
                "`parallel.activation_checkpointing` = 'none'"
            )
        return chosen


def parse_recompute_option(text: str) -> bool | SelectiveRecompute:
    """A recomputation option on a command line: "none", "full", or "selective[:key=value,...]" with the fields of
    SelectiveRecompute (lists joined by "+", each key once), e.g. "selective:part=ffn,save=experts+attention",
    "selective:layers=linear_attention,save=", "selective:every=2" -> what
    `HybridForCausalLM.set_activation_checkpointing` takes. Raises ValueError naming the bad item."""
    if text in ("none", "full"):
        return text == "full"
    kind, _, spec = text.partition(":")
    if kind != "selective":
        raise ValueError(f"got {text!r}: give none, full or selective[:key=value,...]")
    fields = {f.name for f in dataclasses.fields(SelectiveRecompute)}
    kwargs: dict = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"got {item!r} in {text!r}: write key=value with a key among {', '.join(sorted(fields))}")
        if key in kwargs:
            raise ValueError(f"got {key!r} twice in {text!r}: give each key once")
        if key == "every":
            if not value.isdigit():
                raise ValueError(f"got every={value!r} in {text!r}: give a positive integer")
            kwargs[key] = int(value)
        else:
            kwargs[key] = value if key == "part" else tuple(filter(None, value.split("+")))
    try:
        return SelectiveRecompute(**kwargs)
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None
