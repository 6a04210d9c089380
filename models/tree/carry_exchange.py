"""Prefix carry at run time: the layers of a carry microbatch read what earlier microbatches of the step
exported and export what later ones read; `CarryExchange` holds those tensors between the step's events.

Legend: C own compact rows (physical order), P / Xc / X / Y carried attention, conv, replay rows and states
(`models.tree.carry_microbatch_layout`), D model dim, X_ conv channels, HV value heads, K/V head dims.

Per layer (`CarryContext.mix`), besides what `models.tree.mixers` does for a tree microbatch:
- full attention: keys and values are [own C; carried P] (`TreeAttentionLayout.context_rows`); it exports the keys
  and values of its rows that later parts see as context. MLA exports its compressed rows instead (normed latent
  `[R]` and shared key `[P]`, 576 values per row in Kimi-Linear's shapes against 5,120 for projected keys and values)
  and the reader decompresses [own; carried] latents in one call (`MLA.decompress`, per row);
- linear attention: the conv reads [own C; carried Xc] conv inputs as the initial conv states, the core reads
  [own C; carried X] core inputs (replay rows) and starts sequences from the carried states (the state table's
  entries 1..Y); it exports conv inputs, core inputs and chunk-boundary states.

Autograd. A consumer reads a producer's exports through leaves (`detach().requires_grad_()`), so its backward stops
there and sums their gradients over all its consumers in `.grad`. The producer's backward, after the backward of
every consumer, is one `torch.autograd.backward([loss, *exports], [None, *leaf grads])`: the injected gradients join
those of its own loss in one traversal. Under activation recomputation the exports are computed inside the
checkpointed layer call (its recomputation computes them again and keeps the forward's), so between its forward and
its backward a producer holds its layer inputs, its exports and the rest of its loss graph, as any microbatch does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from models.attention_core import AttentionRows
from models.linear_attention import CoreInputs, LinearAttention
from models.mla import MLA
from models.tree.attention import tree_attention
from models.tree.carry_microbatch_layout import CarryLinks, Index
from models.tree.mixers import TreeContext, linear_attention_states, read_rows
from models.tree.regions import region

__all__ = ["NAMES", "LATENT_NAMES", "carried_names", "CarryTraffic", "CarryContext", "CarryExchange"]

#: The tensors of each kind a layer carries: full-attention keys and values (MLA: `LATENT_NAMES`); linear attention's
#: conv inputs, core inputs (`models.linear_attention.CoreInputs` fields) and states.
NAMES = {"attention": ("k", "v"), "conv": ("conv",), "replay": ("q", "k", "v", "g", "beta"), "state": ("state",)}
#: What MLA carries for its context rows (`models.mla.MLALatents` fields): decompressing them again costs one
#: [P, R] x [R, H * (N + V)] GEMM, carrying projected keys and values 8.9x the bytes (and as much again in gradients).
LATENT_NAMES = ("kv_latent", "k_shared")

Reader = Callable[[nn.Module, str, Sequence[str]], dict[str, torch.Tensor]]


def _cat(own: torch.Tensor, carried: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if not carried:
        return own
    with region("carried context"):
        return torch.cat([own, carried[name]])


def carried_names(mixer: nn.Module, kind: str) -> tuple[str, ...]:
    """The tensors `mixer` carries of `kind`."""
    return LATENT_NAMES if kind == "attention" and isinstance(mixer, MLA) else NAMES[kind]


def _take(x: torch.Tensor, rows: Index) -> torch.Tensor:
    """Rows of x as a tensor of their own: an export must not keep the whole layer's tensor alive through a view."""
    with region("carry export"):
        return x[rows].clone() if isinstance(rows, slice) else x[rows]


class CarryTraffic:
    """What crosses into and out of one carry forward. `read(mixer, kind, names)` returns the tensors `names`
    (`carried_names`: `NAMES[kind]`, MLA's attention `LATENT_NAMES`) carried in for that mixer (empty when none);
    `exports` are the export rows (`CarryLinks.exports`); `exported` collects, per mixer, what its forward exported.

    A plain object on purpose: FSDP2 walks the dataclasses among a unit's inputs for tensors that need gradients and
    rebuilds them (`dataclasses.replace`), so what the layers write must sit behind a reference it does not walk."""

    def __init__(self, exports: dict[str, Index | tuple[int, ...]], read: Reader):
        self.exports = exports
        self.read = read
        self.exported: dict[nn.Module, dict[str, torch.Tensor]] = {}


@dataclass
class CarryContext(TreeContext):
    """TreeContext of a carry microbatch: its layers read and write `traffic`."""

    traffic: CarryTraffic = field(default_factory=lambda: CarryTraffic({}, lambda mixer, kind, names: {}))

    @property
    def exports(self) -> dict[str, Index | tuple[int, ...]]:
        return self.traffic.exports

    def read(self, mixer: nn.Module, kind: str) -> dict[str, torch.Tensor]:
        return self.traffic.read(mixer, kind, carried_names(mixer, kind))

    def mix(self, mixer: nn.Module, h_CD: torch.Tensor) -> torch.Tensor:
        """The layer's token mixer on normed own rows `[C, D]` -> `[C, D]`, recording its exports (recomputation's
        repeat of them is dropped: the forward's are the ones the consumers read)."""
        if isinstance(mixer, LinearAttention):
            out, exported = self._linear(mixer, h_CD)
        else:
            out, exported = self._attention(mixer, h_CD)
        self.traffic.exported.setdefault(mixer, exported)
        return out

    def _rows(self, x: torch.Tensor, kind: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        rows = self.exports.get(kind)
        return {} if rows is None else {name: _take(getattr(x, name), rows) for name in names}

    def _attention(self, mixer: nn.Module, h_CD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        layout = self.layout
        carried, names = self.read(mixer, "attention"), carried_names(mixer, "attention")
        if isinstance(mixer, MLA):
            latents = mixer.latents(h_CD, layout.positions)
            exported = self._rows(latents, "attention", names)
            rows = AttentionRows(latents.q, *mixer.decompress(*(_cat(getattr(latents, n), carried, n) for n in names)))
        else:
            rows = mixer.project(h_CD, layout.positions)
            exported = self._rows(rows, "attention", names)
            rows = AttentionRows(rows.q, *(_cat(getattr(rows, n), carried, n) for n in names), rows.gate)
        o = tree_attention(rows.q, rows.k, rows.v, layout.attention, mixer.scale, self.attention_backend,
                           mixer.kernels.attention)
        return mixer.output(o, rows), exported

    def _linear(self, mixer: LinearAttention, h_CD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        layout = self.layout
        rows = mixer.project(h_CD)
        carried = self.read(mixer, "conv")
        qkv = mixer.conv_restarted(rows.qkv, layout.seq_cu, layout.conv_fix, carried["conv"] if carried else None)
        inputs = mixer.activate(rows, qkv)
        replay = self.read(mixer, "replay")
        core_inputs = CoreInputs(*(read_rows(_cat(getattr(inputs, n), replay, n), layout.linear_gather)
                                   for n in NAMES["replay"]))
        o, states = linear_attention_states(mixer, core_inputs, layout, self.read(mixer, "state").get("state"),
                                            self.exports.get("state"))
        exported = {**self._rows(inputs, "replay", NAMES["replay"])}
        if "conv" in self.exports:
            exported["conv"] = _take(rows.qkv, self.exports["conv"])
        if states is not None:
            exported["state"] = states
        return mixer.output(read_rows(o, layout.linear_keep), rows), exported


class CarryExchange:
    """The tensors that cross microbatches within one step on this process.

    After slot m's forward (`keep`) it holds m's loss and exports, and leaves of the exports that m's consumers read;
    `backward(m)` injects the gradients the consumers left on those leaves and frees m. Microbatches are named by
    slot; `links[m]` says what slot m imports and exports, None for a microbatch that carries nothing (HARTS: it runs
    under a plain TreeContext, and its backward is its loss's alone).
    """

    def __init__(self, links: Sequence[CarryLinks | None]):
        self.links = list(links)
        self.consumers = [set() for _ in self.links]
        for m, link in enumerate(self.links):
            for producer in () if link is None else link.producers:
                self.consumers[producer].add(m)
        self.traffic: dict[int, CarryTraffic] = {}
        self.open: dict[int, tuple[torch.Tensor | None, dict[nn.Module, dict[str, torch.Tensor]]]] = {}
        self.leaves: dict[int, dict[nn.Module, dict[str, torch.Tensor]]] = {}
        self.finished: set[int] = set()

    def reader(self, slot: int) -> Reader:
        """`CarryContext.read` of slot `slot`: its imports gathered from the producers' leaves."""
        missing = sorted(p for p in self.links[slot].producers if p not in self.leaves)
        if missing:
            raise ValueError(
                f"microbatch {slot} reads microbatches {missing}, which have not run their forward: every forward "
                "must come after the forwards of the microbatches it reads (planner event order)"
            )
        imports = self.links[slot].imports

        def read(mixer: nn.Module, kind: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
            runs = imports.get(kind)
            if not runs:
                return {}
            out = {}
            for name in names:
                pieces = [self.leaves[p][mixer][name][rows] for p, rows in runs]
                out[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return out

        return read

    def context(self, slot: int, layout, attention_backend) -> TreeContext:
        """The context a forward of slot `slot` runs under (`models.decoder.HybridForCausalLM.forward`): a
        CarryContext reading its imports and recording its exports, a plain TreeContext when it has no links."""
        link = self.links[slot]
        if link is None:
            return TreeContext(layout, attention_backend)
        self.traffic[slot] = CarryTraffic(link.exports, self.reader(slot))
        return CarryContext(layout, attention_backend, self.traffic[slot])

    def keep(self, slot: int, loss: torch.Tensor | None) -> None:
        """After slot `slot`'s forward: keep its exports (and `loss` for its backward; None when scoring) and make
        the leaves its consumers read."""
        traffic = self.traffic.pop(slot, None)
        exported = {} if traffic is None else traffic.exported
        self.open[slot] = (loss, exported)
        self.leaves[slot] = {
            mixer: {name: t.detach().requires_grad_(t.requires_grad) for name, t in tensors.items()}
            for mixer, tensors in exported.items()
        }

    def backward(self, slot: int) -> None:
        """Backward of slot `slot`'s loss with the gradients its consumers sent to its exports, in one traversal."""
        pending = sorted(self.consumers[slot] - self.finished)
        if pending:
            raise ValueError(
                f"microbatch {slot}'s backward comes before the backward of microbatches {pending}, which read it: "
                "a backward must come after the backwards of every microbatch reading it (planner event order)"
            )
        loss, exported = self.open.pop(slot)
        tensors, grads = [loss], [None]
        for mixer, tensors_of in exported.items():
            for name, t in tensors_of.items():
                grad = self.leaves[slot][mixer][name].grad
                if grad is not None:
                    tensors.append(t)
                    grads.append(grad)
        torch.autograd.backward(tensors, grads)
        del self.leaves[slot]
        self.finished.add(slot)

    def check_finished(self) -> None:
        """Every forwarded microbatch ran its backward."""
        if self.open:
            raise ValueError(
                f"microbatches {sorted(self.open)} ran their forward but no backward: every forward event needs a "
                "later backward event"
            )
