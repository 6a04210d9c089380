"""Layouts of prefix-carry microbatches: parts of trees larger than a microbatch, and what crosses
between them (host side, numpy; built once per step).

Legend: C own compact rows of a microbatch (physical order), P carried full-attention context rows (all its parts),
Xc carried conv rows, X carried replay rows, Y carried states, N input sequences, W conv width, S scored positions.

A tree (one connected component of the step's trie, packed alone by `planner.pack.pack`) is cut into parts:
contiguous ranges [start, stop) of its preorder rows. In preorder every ancestor of a part's rows that lies outside
the part is an ancestor of its first row, so a part's context is one root path, the rows at positions 0 .. P-1
above its first row. A microbatch holds whole parts (of one or several trees) and executes their rows only: its
segment tree has an external root (`planner.calls.segment_tree.SegmentTree.external`, path = the part's index in the
microbatch) wherever a row's parent is a context row, and its plan starts such a root at a(p) = floor(p/B)*B from
the path's state there, replaying the path's rows [a(p), p).

Per layer, a microbatch reads from earlier microbatches (its imports) and offers to later ones (its exports), each
of four kinds:
- "attention": keys and values of all context rows (full attention's keys and values are [C own; P carried]);
- "conv": conv inputs (pre-conv q|k|v) of the W-1 path predecessors of sequences that start right below the context;
- "replay": core inputs (q, k, v, g, beta) of the context rows that sequences replay;
- "state": the linear-attention state at an anchor a(p) > 0 of the context path, i.e. the state after the
  producer's row at a(p) - 1 (a requested chunk-boundary state of the producer's plan,
  `planner.calls.plan.ExecutionPlan.exported_states`).
Row exports are physical rows of the producer, state exports indices of its state table. An import of a kind is a
list of runs (producer slot, indices into the producer's export of that kind); concatenated in order they are the
carried rows in the order this layout reads them: by part, then position.

A semantic position is scored in the part that holds its logit row (the row of the previous position; a first
token, which predicts nothing, in the part that holds its own row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.tree.attention import TreeAttentionLayout
from models.tree.branch_attention import branch_groups
from models.tree.core_calls import core_calls_and_exports
from models.tree.device_copy import to_device
from models.tree.layout import TreeLayout, ancestor_rows
from planner.calls.plan import ExecutionPlan, build_execution_plan
from planner.calls.schedule import min_call_schedule
from planner.calls.segment_tree import SegmentTree
from planner.index_arrays import offsets
from planner.pack import CompactBatch

__all__ = ["KINDS", "Part", "CarryLinks", "CarryLayout", "carry_layouts"]

KINDS = ("attention", "conv", "replay", "state")


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) (tree-local preorder rows) of tree `tree`."""

    tree: int
    start: int
    stop: int


Index = torch.Tensor | slice
"""Rows to read: a slice when they are one increasing range (a view), else an int64 tensor on the device."""


def _index(rows: np.ndarray) -> Index:
    if rows.size and np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
        return slice(int(rows[0]), int(rows[0]) + rows.size)
    return torch.as_tensor(rows, dtype=torch.int64)


@dataclass(eq=False)
class CarryLinks:
    """What one microbatch exports to later microbatches and imports from earlier ones, per kind (`KINDS`).

    exports: kind -> physical rows of this microbatch ("state": state-table indices, host ints); empty kinds are
        left out.
    imports: kind -> runs (producer slot, rows of the producer's export of that kind); empty kinds are left out.
    """

    exports: dict[str, Index | tuple[int, ...]]
    imports: dict[str, list[tuple[int, Index]]]

    @property
    def producers(self) -> set[int]:
        """Slots of the microbatches this one reads."""
        return {slot for runs in self.imports.values() for slot, _ in runs}


@dataclass(eq=False)
class CarryLayout:
    """What one carry microbatch executes, on the trainer device (`models.carry_microbatch` makes it a
    `models.microbatch.Microbatch`)."""

    parts: tuple[Part, ...]
    """Its parts: tree index and preorder rows [start, stop)."""
    layout: TreeLayout
    """What every layer reads (own rows in physical order; carried rows after them where a layer reads them)."""
    links: CarryLinks
    """What it imports from earlier microbatches and exports to later ones."""
    call_plan: ExecutionPlan
    """The linear-attention plan of its own rows (external roots where a part hangs below its context)."""
    scored: list[np.ndarray]
    """Per part: the positions of its tree's semantic arrays scored here (ascending); log-probs come in this order."""


class _Rows:
    """One microbatch's own rows (host): parts, local compact offsets, context paths, segment tree and schedule."""

    def __init__(self, parts: Sequence[Part], batches: dict[int, CompactBatch], chunk: int):
        self.parts = tuple(parts)
        self.batches = [batches[p.tree] for p in self.parts]
        self.offsets = offsets([p.stop - p.start for p in self.parts])
        self.context = [ancestor_rows(b, int(b.parent[p.start])) for p, b in zip(self.parts, self.batches)]
        parent, start, end, external, seg_offsets = [], [], [], [], [np.zeros(1, dtype=np.int64)]
        base = 0
        for i, (p, b) in enumerate(zip(self.parts, self.batches)):
            g0 = int(b.segment[p.start])
            g = np.arange(g0, int(b.segment[p.stop - 1]) + 1)
            lo = np.maximum(b.seg_offsets[g], p.start)
            hi = np.minimum(b.seg_offsets[g + 1], p.stop)
            pg = b.seg_parent[g]
            # A piece's parent is local when it starts its segment and the parent segment ends inside the part.
            inside = (lo == b.seg_offsets[g]) & (pg >= 0) & (b.seg_offsets[pg + 1] > p.start)
            parent.append(np.where(inside, base + pg - g0, -1))
            start.append(b.positions[lo])
            end.append(b.positions[hi - 1] + 1)
            external.append(np.where(~inside & (b.positions[lo] > 0), i, -1))
            seg_offsets.append(self.offsets[i] + hi - p.start)
            base += g.size
        self.tree = SegmentTree(np.concatenate(parent), np.concatenate(start), np.concatenate(end),
                                external=np.concatenate(external))
        self.seg_offsets = np.concatenate(seg_offsets)
        self.schedule = min_call_schedule(self.tree, chunk)

    @property
    def num_compact(self) -> int:
        return int(self.offsets[-1])

    def part_of(self, local: np.ndarray) -> np.ndarray:
        """Part index of local compact rows."""
        return np.searchsorted(self.offsets, local, side="right") - 1

    def global_row(self, local: int) -> tuple[int, int]:
        """(part index, tree row) of a local compact row."""
        i = int(self.part_of(np.asarray(local)))
        return i, self.parts[i].start + local - int(self.offsets[i])

    def plan(self, exported_rows: np.ndarray | None = None) -> ExecutionPlan:
        return build_execution_plan(self.schedule, self.seg_offsets, exported_rows)

    def sequence_predecessors(self, plan: ExecutionPlan, width: int):
        """Per input sequence: (part, tree rows of its first row's W-1 path predecessors, oldest first; -1 none)."""
        cu = plan.seq_row_offsets
        for n in range(cu.size - 1):
            i, r = self.global_row(int(plan.physical_to_compact[cu[n]]))
            parent = self.batches[i].parent
            pred = np.full(width - 1, -1, dtype=np.int64)
            for j in range(width - 2, -1, -1):
                r = int(parent[r])
                if r < 0:
                    break
                pred[j] = r
            yield i, pred


def _needs(rows: _Rows, plan: ExecutionPlan, width: int, attention: bool,
           linear: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per kind, the context entries a microbatch reads: (part [n], position [n]), sorted by part then position.
    A "state" entry's position is its anchor (the state after the row before it)."""
    empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    lengths = np.array([c.size for c in rows.context], dtype=np.int64)
    needs = {kind: empty for kind in KINDS}
    if attention:
        needs["attention"] = (np.repeat(np.arange(lengths.size), lengths),
                              np.arange(lengths.sum()) - np.repeat(offsets(lengths)[:-1], lengths))
    if linear:
        conv = {(i, int(rows.batches[i].positions[r])) for i, pred in rows.sequence_predecessors(plan, width)
                for r in pred[pred >= 0] if r < rows.parts[i].start}
        keys = np.array(sorted(conv), dtype=np.int64).reshape(-1, 2)
        needs["conv"] = (keys[:, 0].copy(), keys[:, 1].copy())
        needs["replay"] = (plan.external_context, plan.external_position)
        needs["state"] = (plan.external_state_context, plan.external_state_position - 1)
    return needs


def _conv_context(rows: _Rows, plan: ExecutionPlan, width: int, conv_keys: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """[N, W-1] rows each sequence's conv starts from: own physical rows, or C + index of a carried conv row."""
    C = rows.num_compact
    stride = int(conv_keys[1].max(initial=0)) + 1
    part_keys = conv_keys[0] * stride + conv_keys[1]
    out = []
    for i, pred in rows.sequence_predecessors(plan, width):
        p, b = rows.parts[i], rows.batches[i]
        own = pred >= p.start
        mapped = np.full(pred.size, -1, dtype=np.int64)
        mapped[own] = plan.compact_to_physical[rows.offsets[i] + pred[own] - p.start]
        outside = (pred >= 0) & ~own
        mapped[outside] = C + np.searchsorted(part_keys, i * stride + b.positions[pred[outside]])
        out.append(mapped)
    return np.stack(out) if out else np.zeros((0, width - 1), dtype=np.int64)


def _attention_layout(rows: _Rows, plan: ExecutionPlan) -> TreeAttentionLayout:
    """Ancestor visibility over [C own rows; P context rows]: per part a preorder block [context path; own rows]."""
    C = rows.num_compact
    lengths = np.array([c.size for c in rows.context], dtype=np.int64)
    carried_at = C + offsets(lengths)[:-1]  # where part i's context rows start among the keys
    own_rank, own_end, ctx_rank, ctx_end = [], [], [], []
    block = 0
    for i, (p, b) in enumerate(zip(rows.parts, rows.batches)):
        P, n = int(lengths[i]), p.stop - p.start
        ctx_rank.append(block + np.arange(P))
        ctx_end.append(block + P + np.minimum(b.subtree_end[rows.context[i]], p.stop) - p.start)
        own_rank.append(block + P + np.arange(n))
        own_end.append(block + P + np.minimum(b.subtree_end[p.start : p.stop], p.stop) - p.start)
        block += P + n
    p2c = plan.physical_to_compact
    pre = np.concatenate([np.concatenate(own_rank)[p2c], *ctx_rank])
    pre_end = np.concatenate([np.concatenate(own_end)[p2c], *ctx_end])
    cu = plan.seq_row_offsets
    views, kv_lengths = [], []
    for n in range(cu.size - 1):
        i, r = rows.global_row(int(p2c[cu[n]]))
        p, b = rows.parts[i], rows.batches[i]
        anc = ancestor_rows(b, int(b.parent[r]))
        own = anc >= p.start
        views.append(np.where(own, plan.compact_to_physical[np.where(own, rows.offsets[i] + anc - p.start, 0)],
                              carried_at[i] + b.positions[anc]))
        views.append(np.arange(cu[n], cu[n + 1]))
        kv_lengths.append(anc.size + cu[n + 1] - cu[n])
    as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
    kv_index = np.concatenate(views) if views else np.zeros(0, np.int64)
    return TreeAttentionLayout(
        pre=as_t(pre), pre_end=as_t(pre_end),
        kv_index=as_t(kv_index),
        groups=branch_groups(cu, offsets(kv_lengths), C + int(lengths.sum()), kv_index),
        context_rows=int(lengths.sum()),
    )


def _scored(rows: _Rows, plan: ExecutionPlan) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Per part the positions scored here, and over all of them the logit rows [S] (physical, -1 for first tokens)
    and targets [S]."""
    scored, logit_rows, targets = [], [], []
    for i, (p, b) in enumerate(zip(rows.parts, rows.batches)):
        holder = np.where(b.logit_row >= 0, b.logit_row, b.sem_to_compact)
        sel = np.flatnonzero((holder >= p.start) & (holder < p.stop))
        lr = b.logit_row[sel]
        logit_rows.append(np.where(lr >= 0, plan.compact_to_physical[rows.offsets[i] + np.maximum(lr, p.start)
                                                                     - p.start], -1))
        targets.append(b.sem_tokens[sel])
        scored.append(sel)
    return scored, np.concatenate(logit_rows), np.concatenate(targets)


def _check_parts(microbatches: Sequence[Sequence[Part]], batches: dict[int, CompactBatch]) -> None:
    """Every tree a part names is cut into parts that cover its rows exactly once, each in one microbatch."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for parts in microbatches:
        for p in parts:
            ranges.setdefault(p.tree, []).append((p.start, p.stop))
    for tree, spans in ranges.items():
        rows = batches[tree].num_compact
        spans.sort()
        ends = [0] + [stop for _, stop in spans]
        if any(start != end or stop <= start for (start, stop), end in zip(spans, ends)) or ends[-1] != rows:
            raise ValueError(
                f"the parts of tree {tree} must cover its {rows} rows exactly once as ranges [start, stop) with "
                f"stop > start, got {spans}: plan every row of the tree into one part on this replica"
            )


def carry_layouts(
    batches: dict[int, CompactBatch], microbatches: Sequence[Sequence[Part]], chunk: int, conv_size: int,
    attention: bool, linear: bool, device=None,
) -> list[CarryLayout]:
    """The layouts and links of one replica's carry microbatches.

    Args:
        batches: tree index -> the tree packed alone (`planner.pack.pack` of its trajectories).
        microbatches: in slot order, each microbatch's parts; together the parts of a tree cover its rows once.
        chunk, conv_size: the model's chunk size B and conv width W.
        attention, linear: whether the model has full-attention / linear-attention layers (what is carried).
    """
    _check_parts(microbatches, batches)
    locals_ = [_Rows(parts, batches, chunk) for parts in microbatches]
    plans = [rows.plan() for rows in locals_]
    needs = [_needs(rows, plan, conv_size, attention, linear) for rows, plan in zip(locals_, plans)]

    # Who owns each tree row: the parts of each tree sorted by start -> (slot, part index).
    owned: dict[int, list[tuple[int, int, int]]] = {}
    for m, rows in enumerate(locals_):
        for i, p in enumerate(rows.parts):
            owned.setdefault(p.tree, []).append((p.start, m, i))
    # Per tree, its parts by start: their starts, slots and the local compact row of their first rows.
    owners = {}
    for t, v in owned.items():
        v.sort()
        owners[t] = tuple(np.array(column, dtype=np.int64) for column in zip(*[
            (start, m, int(locals_[m].offsets[i])) for start, m, i in v]))

    # Resolve every entry to (producer slot, producer's local compact row); collect the export requests.
    resolved: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    requests = [{kind: [] for kind in KINDS} for _ in locals_]
    for m, (rows, need) in enumerate(zip(locals_, needs)):
        resolved.append({})
        for kind, (part, position) in need.items():
            slot, local = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
            for i in np.unique(part).tolist():
                r = rows.context[i][position[part == i]]
                starts, slots, firsts = owners[rows.parts[i].tree]
                k = np.searchsorted(starts, r, side="right") - 1
                if (slots[k] == m).any():
                    raise ValueError(
                        f"microbatch {m} holds a part of tree {rows.parts[i].tree} that reads rows of another of its "
                        "parts: parts of one tree that depend on each other go to different microbatches"
                    )
                slot.append(slots[k])
                local.append(firsts[k] + r - starts[k])
            slot, local = np.concatenate(slot), np.concatenate(local)
            resolved[m][kind] = (slot, local)
            for mp in np.unique(slot).tolist():
                requests[mp][kind].append(local[slot == mp])
    exported = [{kind: np.unique(np.concatenate(req[kind])) if req[kind] else np.zeros(0, dtype=np.int64)
                 for kind in KINDS} for req in requests]

    out = []
    for m, rows in enumerate(locals_):
        plan = rows.plan(exported[m]["state"]) if exported[m]["state"].size else plans[m]
        calls, keep, state_table = core_calls_and_exports(plan)
        exports = {kind: _index(plan.compact_to_physical[exported[m][kind]])
                   for kind in KINDS if kind != "state" and exported[m][kind].size}
        if state_table.size:
            exports["state"] = tuple(state_table.tolist())
        imports = {}
        for kind, (slot, local) in resolved[m].items():
            cut = np.flatnonzero(np.diff(slot)) + 1
            runs = [(int(s[0]), _index(np.searchsorted(exported[int(s[0])][kind], loc)))
                    for s, loc in zip(np.split(slot, cut), np.split(local, cut)) if s.size]
            if runs:
                imports[kind] = runs
        p2c = plan.physical_to_compact
        cat = lambda name: np.concatenate(  # noqa: E731
            [getattr(b, name)[p.start : p.stop] for p, b in zip(rows.parts, rows.batches)])[p2c]
        scored, logit_row, target = _scored(rows, plan)
        layout = TreeLayout.assemble(
            plan, (calls, keep), cat("tokens"), cat("positions"), cat("multiplicity"),
            (plan.seq_row_offsets, _conv_context(rows, plan, conv_size, needs[m]["conv"])),
            _attention_layout(rows, plan),
            logit_row, target, carried_replay_rows=int(plan.external_context.size),
        )
        layout, links = to_device((layout, CarryLinks(exports, imports)), device)
        out.append(CarryLayout(rows.parts, layout, links, plan, scored))
    return out
