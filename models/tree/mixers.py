"""Token mixers on the compact rows of a rollout-tree microbatch (HARTS §3.4-3.5), and the context that runs them.

Legend: C compact rows (physical order of the plan), D model dim, X conv channels, N input sequences, W conv width,
HV value heads, K/V head dims.

A mixer's row-wise steps (projections, norms, activations, output projection) run once per compact row (linear
attention: also once more per replay row, below). What couples rows follows the tree:
- full attention: a row sees its path ancestors and itself (`models.tree.attention`), RoPE at original positions;
- the linear-attention core: the plan's rounds as kernel calls (`models.tree.core_calls`); side branches start from
  chunk-boundary states produced by earlier calls and replay [floor(p/B)*B, p) of already-activated ancestor rows
  (state updates only); the states are tensors in the graph, so every consumer's gradient reaches their producer.
  The whole mixer runs on the calls' rows, call after call (replay rows included: under 1% more rows on SWE-like
  trees), so only its D-wide input and output are gathered, not the core's five inputs and its output;
- the short conv: each piece of a call sees the W-1 rows preceding it on its own path (never a packing neighbour):
  its first W-1 rows are recomputed from them after a convolution from zeros (`models.ops.conv.recomputed_rows`).
`TreeContext` is what `models.decoder.DecoderLayer` asks to mix (the tree counterpart of `FlatContext`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.attention_core import AttentionRows
from models.linear_attention import CoreInputs, LinearAttention
from models.tree.attention import Backend, tree_attention
from models.tree.layout import TreeLayout
from models.tree.row_gather import RowGather

__all__ = ["TreeContext", "linear_attention_states", "tree_linear_mixer",
           "tree_attention_mixer", "read_rows"]


def read_rows(x: torch.Tensor, rows: RowGather | slice | None) -> torch.Tensor:
    """Rows of x as a layout names them (None: all, in order)."""
    return x if rows is None else x[rows] if isinstance(rows, slice) else rows(x)


def linear_attention_states(
    mixer: LinearAttention, inputs: CoreInputs, layout: TreeLayout, outside: torch.Tensor | None = None,
    exported: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the core as the layout's kernel calls (`LinearAttention.core_calls`).

    `inputs` holds the calls' rows, call after call (tree execution: the mixer's rows, `layout.mixer_rows`; prefix
    carry: read by `layout.linear_gather`). The calls' sequences start
    from entries of the state table: zeros, then `outside` `[Y, HV, K, V]` fp32 (prefix carry: states of paths
    executed in earlier parts, entries 1..Y), then every call's final states in order (`models.tree.core_calls`);
    the table is a tensor in the graph, so gradients reach each producer. Returns (o `[T, HV, V]` of the calls' rows,
    replay rows included, `layout.linear_keep` picks the physical rows' outputs; the table entries `exported` names,
    `[Z, HV, K, V]`, or None)."""
    o, table = mixer.core_calls(inputs, layout.linear_calls, outside)
    return o, table[list(exported)] if exported else None


def tree_linear_mixer(mixer: LinearAttention, h_CD: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """GDN / KDA over compact rows -> `[C, D]`: every step on the calls' rows (`layout.mixer_rows`: the layer input
    gathered once, D wide), the conv's sequences restarted at each piece with their path history, the core as the
    layout's calls, the output rows of the physical rows picked by `layout.linear_keep`."""
    rows = mixer.project(read_rows(h_CD, layout.mixer_rows))
    qkv = mixer.conv_restarted(rows.qkv, layout.seq_cu, layout.conv_fix)
    o, _ = linear_attention_states(mixer, mixer.activate(rows, qkv), layout)
    return read_rows(mixer.output(o, rows), layout.linear_keep)


def tree_attention_mixer(mixer: nn.Module, h_CD: torch.Tensor, layout: TreeLayout, backend: Backend) -> torch.Tensor:
    """Gated attention / MLA over compact rows: ancestor-or-self attention at original positions -> `[C, D]`."""
    rows: AttentionRows = mixer.project(h_CD, layout.positions)
    o = tree_attention(rows.q, rows.k, rows.v, layout.attention, mixer.scale, backend, mixer.kernels.attention)
    return mixer.output(o, rows)


@dataclass
class TreeContext:
    """What every decoder layer needs for tree execution of one microbatch: its layout and the full-attention
    backend. Activation recomputation re-reads the same context (nothing is re-planned)."""

    layout: TreeLayout
    attention_backend: Backend = "dense"

    @property
    def row_weight(self) -> torch.Tensor:
        """`[C]` float64 multiplicities: MoE statistics count each row once per trajectory through it."""
        return self.layout.row_weight

    def mix(self, mixer: nn.Module, h_CD: torch.Tensor) -> torch.Tensor:
        """The layer's token mixer on normed compact rows `[C, D]` -> `[C, D]`."""
        if isinstance(mixer, LinearAttention):
            return tree_linear_mixer(mixer, h_CD, self.layout)
        return tree_attention_mixer(mixer, h_CD, self.layout, self.attention_backend)
