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
from models.ops.kda.call_arrays import CallArrays
from models.tree.attention import TreeAttentionLayout
from models.tree.branch_attention import branch_groups
from models.tree.core_calls import CoreCall, core_calls
from models.tree.device_copy import to_device
from models.tree.round_chains import RoundChains, table_entries
from models.tree.row_gather import RowGather
from planner.index_arrays import offsets
from planner.pack import CompactBatch

__all__ = ["CoreCallTensors", "CoreCalls", "TreeLayout", "ancestor_rows", "build_attention_layout", "conv_context_rows",
           "row_reader"]


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
    max_view_rows: int | None = None,
) -> TreeAttentionLayout:
    """TreeAttentionLayout for rows in physical order, on the host (`models.tree.device_copy.to_device` moves it).

    Args:
        batch: the packed microbatch (compact rows in trie preorder).
        physical_to_compact: [C] compact row of each physical row; compact_to_physical [C]: its inverse
            (planner.calls.plan.ExecutionPlan holds both).
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
    as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
    kv_index = np.concatenate(views) if views else np.zeros(0, np.int64)
    return TreeAttentionLayout(
        pre=as_t(physical_to_compact),
        pre_end=as_t(batch.subtree_end[physical_to_compact]),
        kv_index=as_t(kv_index),
        groups=branch_groups(cu, cu_kv, max_view_rows or physical_to_compact.size, kv_index),
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


def row_reader(index: np.ndarray, rows: int) -> RowGather | slice | None:
    """Reading rows `index` of a source of `rows` rows: None when that is the whole source in order, a slice (a view)
    when it is one contiguous increasing range, else a `RowGather`."""
    if index.size and np.array_equal(index, np.arange(index[0], index[0] + index.size)):
        if index[0] == 0 and index.size == rows:
            return None
        return slice(int(index[0]), int(index[0]) + index.size)
    return RowGather.build(index, rows)


@dataclass
class CoreCallTensors(CallArrays):
    """One linear-attention kernel call (`models.tree.core_calls.CoreCall`); its input rows are the call's part of
    the layer's calls' rows (`CoreCalls.row_bounds`). Its arrays as fla's path takes them (`CallArrays`: the pieces'
    boundaries `[N_k+1]`, fla's chunk indices, and `init_entries`: `init_state` as
    `models.tree.round_chains.table_entries` reads it), and the host bookkeeping of the call-by-call reference."""

    init_state: tuple[int, ...] | None
    """[N_k] state-table index of each piece's initial state (host ints); None when every piece starts from zeros."""
    first_state: int
    """The table index of its first final state (the others follow in piece order)."""
    chunk_offsets: torch.Tensor
    """fla's chunk offsets of `cu_seqlens` (`models.ops.delta_rule.fla_args.fla_chunk_arrays`)."""

    def initial_states(self, table: list[torch.Tensor]) -> torch.Tensor | None:
        """This call's initial states `[N_k, HV, K, V]` from the state table (entries `[HV, K, V]`), None = zeros."""
        return None if self.init_state is None else torch.stack([table[i] for i in self.init_state])

    @staticmethod
    def build(call: CoreCall, chunk_size: int) -> "CoreCallTensors":
        """On the host (`models.tree.device_copy.to_device` moves the tensors but `cu_seqlens_cpu`)."""
        cu = torch.as_tensor(call.cu_seqlens, dtype=torch.int64)
        indices, first = fla_chunk_arrays(call.cu_seqlens, chunk_size)
        entries = table_entries(call.init_state)
        return CoreCallTensors(
            cu_seqlens=cu,
            cu_seqlens_cpu=cu,
            init_state=None if entries is None else tuple(call.init_state.tolist()),
            init_entries=entries,
            first_state=int(call.first_state),
            chunk_indices=torch.as_tensor(indices),
            chunk_offsets=torch.as_tensor(first),
        )


@dataclass
class CoreCalls:
    """A layer's linear-attention kernel calls (`models.tree.core_calls`), in order, and what kernels that work chunk
    by chunk need to run once over all of them.

    The calls' rows are one tensor, call after call. Call k's pieces start from entries of a state table: entry 0
    zeros, entries 1..Y states from outside (prefix carry), then every call's final states in call order, so a call
    reads only entries written before it (a later piece of a cut sequence, or a side branch's chunk-aligned start).

    calls: the calls in order; call_rows: their input rows. cu_seqlens, chunk_indices, chunk_offsets: every piece of
    every call as one packed sequence each, on the device, with fla's chunk bookkeeping (`models.ops.kda.tree_calls`).
    table_size: 1 + Y + all calls' pieces. chains: the same pieces per plan round, each sequence's pieces as one
    chain (`models.tree.round_chains`: a round in one launch).
    """

    calls: list[CoreCallTensors]
    call_rows: list[int]
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_size: int
    table_size: int
    chains: list[RoundChains]

    @property
    def rounds(self) -> int:
        """The plan's rounds the calls came from."""
        return len(self.chains)

    @property
    def row_bounds(self) -> list[int]:
        """[m+1] where each call's rows start among all calls' rows, and their end."""
        return np.concatenate([[0], np.cumsum(self.call_rows)]).tolist()

    @property
    def chunk_bounds(self) -> list[int]:
        """[m+1] where each call's chunks start among all calls' (fla's chunk order: call after call), and their
        end."""
        return np.concatenate([[0], np.cumsum([c.chunk_indices.shape[0] for c in self.calls])]).tolist()

    @property
    def outside_states(self) -> int:
        """Y: the table entries from outside (1..Y)."""
        return self.calls[0].first_state - 1 if self.calls else self.table_size - 1

    def check_outside(self, outside: torch.Tensor | None) -> int:
        """Y of `outside` (`[Y, HV, K, V]`, None: 0), refused unless the calls read exactly that many entries."""
        Y = 0 if outside is None else outside.shape[0]
        if Y != self.outside_states:
            raise ValueError(f"the calls read {self.outside_states} outside state(s) (table entries 1..Y), got {Y}")
        return Y

    @staticmethod
    def build(calls: list[CoreCall], chunk_size: int, table_start: int) -> "CoreCalls":
        """From a layer's calls in order, on the host (`models.tree.device_copy.to_device` moves them); `table_start`
        = 1 + Y, the table index of the first call's first final state."""
        table = table_start
        for call in calls:
            assert call.first_state == table and (call.init_state < table).all(), \
                "each call's pieces start from zeros, outside states or earlier calls' final states"
            table += call.num_sequences
        cu = offsets(np.concatenate([np.diff(c.cu_seqlens) for c in calls]))
        indices, first = fla_chunk_arrays(cu, chunk_size)
        return CoreCalls(
            calls=[CoreCallTensors.build(c, chunk_size) for c in calls], call_rows=[int(c.gather.size) for c in calls],
            cu_seqlens=torch.as_tensor(cu), chunk_indices=torch.as_tensor(indices),
            chunk_offsets=torch.as_tensor(first), chunk_size=chunk_size, table_size=table,
            chains=RoundChains.build(calls, cu, first),
        )


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
    linear_calls: the linear-attention kernel calls in order.
    linear_gather: the rows of [mixer rows; carried replay rows] fed to all calls, call after call (None: all rows
        in order, as in tree execution; a slice when contiguous).
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
    linear_calls: CoreCalls
    linear_gather: RowGather | slice | None
    linear_keep: RowGather | slice | None
    attention: TreeAttentionLayout
    logit_row: torch.Tensor
    target: torch.Tensor
    chunk_size: int

    @property
    def linear_attention_calls(self) -> int:
        """Packed linear-attention kernel calls per layer."""
        return len(self.linear_calls.calls)

    @staticmethod
    def build(batch: CompactBatch, plan, conv_size: int, device=None) -> "TreeLayout":
        """From a packed microbatch and its planner.calls.plan.ExecutionPlan; conv_size W of the linear-attention
        layers. The linear-attention mixers run on the calls' rows (`mixer_rows`)."""
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
            build_attention_layout(batch, p2c, c2p, plan.seq_row_offsets), logit_row, batch.sem_tokens,
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
        rows, with the calls reading `carried_replay_rows` rows after the C physical ones (prefix carry). Built on
        the host and moved to `device` (None: left there) in one copy per dtype (`models.tree.device_copy`)."""
        calls, keep = calls
        if mixer_on_calls and carried_replay_rows:
            raise ValueError("carried replay rows need the mixer on the physical rows (mixer_on_calls=False)")
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
        gather = np.concatenate([c.gather for c in calls])
        gathered = row_reader(gather, tokens.size + carried_replay_rows)
        layout = TreeLayout(
            tokens=as_t(tokens),
            positions=as_t(positions),
            row_weight=torch.as_tensor(multiplicity, dtype=torch.float64),
            mixer_rows=gathered if mixer_on_calls else None,
            seq_cu=as_t(conv[0]),
            conv_fix=RecomputedRows.build(*conv),
            linear_calls=CoreCalls.build(calls, plan.chunk_size, 1 + int(plan.external_state_context.size)),
            linear_gather=None if mixer_on_calls else gathered,
            linear_keep=row_reader(keep, gather.size),
            attention=attention,
            logit_row=as_t(logit_row),
            target=as_t(target),
            chunk_size=plan.chunk_size,
        )
        return layout if device is None else to_device(layout, device)
