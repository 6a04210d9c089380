"""Per-microbatch tensors that every layer of tree execution reads: built once from the packed batch and the plan.

Legend: C compact rows, N branches (input sequences: each is a path of rows, contiguous in physical order),
W conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.ops.conv.recomputed_rows import RecomputedRows
from models.ops.delta_rule.fla_args import fla_chunk_arrays
from models.tree.attention import TreeAttentionLayout
from models.tree.branch_attention import branch_groups
from models.tree.core_calls import CoreCall, core_calls
from models.tree.device_copy import device_views
from models.tree.row_gather import RowGather
from planner.index_arrays import offsets
from planner.pack import CompactBatch

__all__ = ["CoreCallTensors", "CoreRound", "TreeLayout", "core_rounds", "ancestor_rows", "build_attention_layout",
           "conv_context_rows", "row_reader"]


def ancestor_rows(batch: CompactBatch, row: int) -> np.ndarray:
    """Compact rows of the path from the root to `row` (inclusive), root first; walks segments, not tokens."""
    if row < 0:
        return np.zeros(0, dtype=np.int64)
    parts = []
    g = int(batch.segment[row])
    parts.append(np.arange(batch.seg_offsets[g], row + 1))
    g = int(batch.seg_parent[g])
    while g >= 0:
        parts.append(np.arange(batch.seg_offsets[g], batch.seg_offsets[g + 1]))
        g = int(batch.seg_parent[g])
    return np.concatenate(parts[::-1])


def build_attention_layout(
    batch: CompactBatch, physical_to_compact: np.ndarray, compact_to_physical: np.ndarray, cu_seqlens: np.ndarray,
    device=None, max_view_rows: int | None = None,
) -> TreeAttentionLayout:
    """TreeAttentionLayout for rows in physical order.

    Args:
        batch: the packed microbatch (compact rows in trie preorder).
        physical_to_compact: [C] compact row of each physical row; compact_to_physical [C]: its inverse
            (planner.calls.ExecutionPlan holds both).
        cu_seqlens: [N+1] branch boundaries in physical rows; each branch must be one path in position order.
        max_view_rows: view rows per branch-attention kernel call (default C: no group's gathered keys/values
            outgrow the microbatch's own).
    """
    physical_to_compact = np.asarray(physical_to_compact, dtype=np.int64)
    compact_to_physical = np.asarray(compact_to_physical, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    views, kv_lengths = [], []
    for n in range(cu.size - 1):
        first = physical_to_compact[cu[n]]
        anc = compact_to_physical[ancestor_rows(batch, int(batch.parent[first]))]
        views.append(anc)
        views.append(np.arange(cu[n], cu[n + 1]))
        kv_lengths.append(anc.size + cu[n + 1] - cu[n])
    cu_kv = offsets(kv_lengths)
    as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
    kv_index = np.concatenate(views) if views else np.zeros(0, np.int64)
    return TreeAttentionLayout(
        pre=as_t(physical_to_compact),
        pre_end=as_t(batch.subtree_end[physical_to_compact]),
        kv_index=as_t(kv_index),
        groups=branch_groups(cu, cu_kv, max_view_rows or physical_to_compact.size, kv_index, device),
    )


def conv_context_rows(
    batch: CompactBatch, physical_to_compact: np.ndarray, compact_to_physical: np.ndarray, first_rows: np.ndarray,
    width: int,
) -> np.ndarray:
    """[N, W-1] physical rows of the W-1 path predecessors of N sequences' first rows, oldest first; -1 = none.

    physical_to_compact [C] and its inverse compact_to_physical [C] give the physical order, as in
    `build_attention_layout`; first_rows [N] are the physical rows the sequences start with. A sequence's short
    convolution reads these as its history, so its first rows see their true ancestors and never a neighbour in the
    packing.
    """
    physical_to_compact = np.asarray(physical_to_compact, dtype=np.int64)
    compact_to_physical = np.asarray(compact_to_physical, dtype=np.int64)
    first_rows = np.asarray(first_rows, dtype=np.int64)
    out = np.full((first_rows.size, width - 1), -1, dtype=np.int64)
    r = batch.parent[physical_to_compact[first_rows]]  # compact row of each sequence's next predecessor, -1 none
    for j in range(width - 2, -1, -1):
        has = r >= 0
        out[has, j] = compact_to_physical[r[has]]
        r = np.where(has, batch.parent[np.maximum(r, 0)], -1)
    return out


def row_reader(index: np.ndarray, rows: int, device) -> RowGather | slice | None:
    """Reading rows `index` of a source of `rows` rows: None when that is the whole source in order, a slice (a view)
    when it is one contiguous increasing range, else a `RowGather`."""
    if index.size and np.array_equal(index, np.arange(index[0], index[0] + index.size)):
        if index[0] == 0 and index.size == rows:
            return None
        return slice(int(index[0]), int(index[0]) + index.size)
    return RowGather.build(index, rows, device)


@dataclass
class CoreCallTensors:
    """One linear-attention kernel call (`models.tree.core_calls.CoreCall`) on a device; its input rows are the
    call's part of `TreeLayout.linear_gather`."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    """[N_k+1] piece boundaries in `gather`, on the device and on the host (fla needs no host sync then)."""
    init_state: tuple[int, ...] | None
    """[N_k] state-table index of each piece's initial state (host ints); None when every piece starts from zeros."""
    previous: torch.Tensor | None
    """[N_k] where each piece's sequence is among the previous call's of its round (whose final state it starts
    from); None when it is the first call of its round, or continues every sequence of the previous one."""
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    """fla's chunk bookkeeping of `cu_seqlens` (`models.ops.delta_rule.fla_args.fla_chunk_arrays`)."""

    def initial_states(self, round_initial: torch.Tensor | None, previous_finals: torch.Tensor | None
                       ) -> torch.Tensor | None:
        """This call's initial states `[N_k, HV, K, V]`: for a round's first call (`previous_finals` None) the
        round's `round_initial` (None = zeros), else each piece's predecessor among the previous call's final
        states."""
        if previous_finals is None:
            return round_initial
        return previous_finals if self.previous is None else previous_finals[self.previous]

    @staticmethod
    def build(call: CoreCall, previous: CoreCall | None, chunk_size: int) -> "CoreCallTensors":
        """On the host (`core_rounds` moves the index tensors to the device)."""
        cu = torch.as_tensor(call.cu_seqlens, dtype=torch.int64)
        indices, first = fla_chunk_arrays(call.cu_seqlens, chunk_size)
        continues = previous is None or np.array_equal(previous.sequence, call.sequence)
        return CoreCallTensors(
            cu_seqlens=cu,
            cu_seqlens_cpu=cu,
            init_state=None if not call.init_state.any() else tuple(call.init_state.tolist()),
            previous=None if continues else torch.as_tensor(np.searchsorted(previous.sequence, call.sequence)),
            chunk_indices=torch.as_tensor(indices),
            chunk_offsets=torch.as_tensor(first),
        )


@dataclass
class CoreRound:
    """One round of the plan as its kernel calls (`models.tree.core_calls`): call j packs piece j of the round's
    sequences that have one; piece j > 0 starts from the final state of the same sequence's piece j-1.

    calls: the round's calls in order; call_rows: their input rows (consecutive in `TreeLayout.linear_gather`).
    cu_seqlens, chunk_indices, chunk_offsets: every piece of every call as one packed sequence each, on the device,
    with fla's chunk bookkeeping: what kernels that work chunk by chunk need to run once over the whole round
    (`models.ops.kda.round`).
    """

    calls: list[CoreCallTensors]
    call_rows: list[int]
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_size: int

    @property
    def row_bounds(self) -> list[int]:
        """[m+1] where each call's rows start in the round's, and their end."""
        return np.concatenate([[0], np.cumsum(self.call_rows)]).tolist()

    @property
    def chunk_bounds(self) -> list[int]:
        """[m+1] where each call's chunks start among the round's (fla's chunk order: call after call), and their
        end."""
        return np.concatenate([[0], np.cumsum([c.chunk_indices.shape[0] for c in self.calls])]).tolist()

    @property
    def final_bounds(self) -> list[int]:
        """[m+1] where each call's final states start among the round's, and their end."""
        return np.concatenate([[0], np.cumsum([c.cu_seqlens_cpu.numel() - 1 for c in self.calls])]).tolist()

    @property
    def init_state(self) -> tuple[int, ...] | None:
        """State-table index of each sequence's initial state (its first piece's); None: all zeros."""
        return self.calls[0].init_state

    @staticmethod
    def build(calls: list[CoreCall], chunk_size: int) -> "CoreRound":
        """From the consecutive calls of one round, on the host (`core_rounds` moves the index tensors)."""
        for prev, call in zip(calls, calls[1:]):
            pos = np.searchsorted(prev.sequence, call.sequence)
            assert np.isin(call.sequence, prev.sequence).all() and (call.init_state == prev.first_state + pos).all(), \
                "each piece of a later call starts from its sequence's final state in the previous call"
        rows = [int(c.gather.size) for c in calls]
        cu = offsets(np.concatenate([np.diff(c.cu_seqlens) for c in calls]))
        indices, first = fla_chunk_arrays(cu, chunk_size)
        return CoreRound(
            calls=[CoreCallTensors.build(c, p, chunk_size) for p, c in zip([None, *calls], calls)],
            call_rows=rows, cu_seqlens=torch.as_tensor(cu), chunk_indices=torch.as_tensor(indices),
            chunk_offsets=torch.as_tensor(first), chunk_size=chunk_size,
        )


_DEVICE_INDEX_FIELDS = {CoreRound: ("cu_seqlens", "chunk_indices", "chunk_offsets"),
                        CoreCallTensors: ("cu_seqlens", "previous", "chunk_indices", "chunk_offsets")}


def core_rounds(calls: list[CoreCall], chunk_size: int, device) -> list[CoreRound]:
    """The calls (in order, `models.tree.core_calls.core_calls`) grouped by round, their index tensors on `device`
    in one copy (`models.tree.device_copy`: 3-4 of them per call)."""
    bounds = [0, *(i for i in range(1, len(calls)) if calls[i].round != calls[i - 1].round), len(calls)]
    rounds = [CoreRound.build(calls[a:b], chunk_size) for a, b in zip(bounds, bounds[1:])]
    slots = [(obj, name) for r in rounds for obj in (r, *r.calls) for name in _DEVICE_INDEX_FIELDS[type(obj)]
             if getattr(obj, name) is not None]
    for (obj, name), t in zip(slots, device_views([getattr(obj, name) for obj, name in slots], device)):
        setattr(obj, name, t)
    return rounds


@dataclass
class TreeLayout:
    """Everything tree execution of one microbatch needs, as tensors on one device; built once, read by every layer
    and re-read (not rebuilt) by activation recomputation. Rows are in the plan's physical order.

    tokens, positions [C]: token id and original position of each physical row.
    row_weight [C]: multiplicity q of each row (MoE statistics weights).
    mixer_rows: the rows of a layer's input the linear-attention mixer runs on. Tree execution: the rows of all
        kernel calls, call after call (replay rows included: T = C + replay rows), so the mixer's per-row steps, its
        conv and its core read them in the calls' order and only the layer input (D wide) is gathered, not the
        core's five inputs; its output goes back to the physical rows by `linear_keep`. None: the physical rows
        (prefix carry, whose replay rows come from other microbatches).
    seq_cu [N+1]: the short conv's sequences over the mixer's rows (tree execution: every piece of every call; carry:
        the plan's input sequences), each one stretch of a path.
    conv_fix: the rows whose conv window reaches before their sequence's start, recomputed from the W-1 rows
        preceding the sequence on its path (`conv_context_rows`; carry: also carried rows after the C own ones), the
        sequences otherwise convolved from zeros as flat packing does (`models.ops.conv.recomputed_rows`); None when
        no sequence has a predecessor.
    linear_rounds: the linear-attention kernel calls in order, by round.
    linear_gather, linear_round_rows: the rows of [mixer rows; carried replay rows] fed to all calls, call after call
        (None: all rows in order, as in tree execution; a slice when contiguous), and each round's number of them.
    linear_keep: the position of each physical row's output among the calls' concatenated rows (replay outputs are
        dropped; None when that is all of them in order).
    attention: full-attention visibility and branch views.
    logit_row [S], target [S]: for compact_logprobs, in physical rows (-1 for first tokens).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    row_weight: torch.Tensor
    mixer_rows: RowGather | slice | None
    seq_cu: torch.Tensor
    conv_fix: RecomputedRows | None
    linear_rounds: list[CoreRound]
    linear_gather: RowGather | slice | None
    linear_round_rows: list[int]
    linear_keep: RowGather | slice | None
    attention: TreeAttentionLayout
    logit_row: torch.Tensor
    target: torch.Tensor
    chunk_size: int

    @property
    def linear_attention_calls(self) -> int:
        """Packed linear-attention kernel calls per layer."""
        return sum(len(r.calls) for r in self.linear_rounds)

    @staticmethod
    def build(batch: CompactBatch, plan, conv_size: int, device=None) -> "TreeLayout":
        """From a packed microbatch and its planner.calls.ExecutionPlan; conv_size W of the linear-attention layers.
        The linear-attention mixers run on the calls' rows (`mixer_rows`)."""
        p2c = plan.physical_to_compact
        c2p = plan.compact_to_physical
        logit_row = np.where(batch.logit_row >= 0, c2p[np.maximum(batch.logit_row, 0)], -1)
        calls, keep = core_calls(plan)
        gather = np.concatenate([c.gather for c in calls])
        pieces = offsets(np.concatenate([np.diff(c.cu_seqlens) for c in calls]))
        history = conv_context_rows(batch, p2c, c2p, gather[pieces[:-1]], conv_size)
        return TreeLayout.assemble(
            plan, (calls, keep), batch.tokens[p2c], batch.positions[p2c], batch.multiplicity[p2c],
            (pieces, np.where(history >= 0, keep[np.maximum(history, 0)], -1)),
            build_attention_layout(batch, p2c, c2p, plan.seq_row_offsets, device), logit_row, batch.sem_tokens,
            device, mixer_on_calls=True,
        )

    @staticmethod
    def assemble(
        plan, calls: tuple[list[CoreCall], np.ndarray], tokens: np.ndarray, positions: np.ndarray,
        multiplicity: np.ndarray, conv: tuple[np.ndarray, np.ndarray], attention: TreeAttentionLayout,
        logit_row: np.ndarray, target: np.ndarray, device=None, carried_replay_rows: int = 0,
        mixer_on_calls: bool = False,
    ) -> "TreeLayout":
        """The layout's tensors from host arrays: the plan with its kernel calls and kept outputs
        (`models.tree.core_calls`), per physical row [C] token, position and multiplicity, the conv's sequences
        over the mixer's rows with their history (cu [N+1], history [N, W-1] as `conv_context_rows` gives, in the
        mixer's rows), the attention layout, per position [S] logit row (physical, -1 none) and target.
        `mixer_on_calls`: the linear-attention mixers run on the calls' rows (`mixer_rows`), else on the physical
        rows, with the calls reading `carried_replay_rows` rows after the C physical ones (prefix carry)."""
        calls, keep = calls
        if mixer_on_calls and carried_replay_rows:
            raise ValueError("carried replay rows need the mixer on the physical rows (mixer_on_calls=False)")
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
        gather = np.concatenate([c.gather for c in calls])
        gathered = row_reader(gather, tokens.size + carried_replay_rows, device)
        rounds = core_rounds(calls, plan.chunk_size, device)
        return TreeLayout(
            tokens=as_t(tokens),
            positions=as_t(positions),
            row_weight=torch.as_tensor(multiplicity, dtype=torch.float64, device=device),
            mixer_rows=gathered if mixer_on_calls else None,
            seq_cu=as_t(conv[0]),
            conv_fix=RecomputedRows.build(*conv, device),
            linear_rounds=rounds,
            linear_gather=None if mixer_on_calls else gathered,
            linear_round_rows=[sum(r.call_rows) for r in rounds],
            linear_keep=row_reader(keep, gather.size, device),
            attention=attention,
            logit_row=as_t(logit_row),
            target=as_t(target),
            chunk_size=plan.chunk_size,
        )
