"""A layer's calls regrouped by plan round: each sequence of a round as the chain of its pieces across the round's
calls, so a kernel that keeps the state in registers runs a round in one launch (`models.ops.kda.chains`, which takes
them as `models.ops.kda.call_arrays.ChainArrays`).

Legend: N_r sequences of round r, P_r their pieces, M state-table entries.

`models.tree.core_calls` cuts a round's sequences at the chunks where other sequences start, because chunk kernels
return only final states: call j packs piece j of every sequence and piece j+1 starts from the table entry piece j
wrote. A chain is one sequence's pieces in call order. Running it in one program gives the same chunks and states,
written to the same table entries, with one launch per round instead of one per call.
"""

from __future__ import annotations

import numpy as np
import torch

from models.ops.kda.call_arrays import ChainArrays
from models.tree.core_calls import CoreCall
from planner.index_arrays import offsets

__all__ = ["RoundChains", "table_entries"]


class RoundChains(ChainArrays):
    """One round's sequences as chains of pieces (`ChainArrays`, int64 tensors built on the host): rows among the
    layer's calls' rows (`CoreCalls.row_bounds`), first chunks among the calls' chunks (`CoreCalls.chunk_bounds`),
    entries of the layer's state table (`CoreCalls`)."""

    @staticmethod
    def build(calls: list[CoreCall], cu_seqlens: np.ndarray, chunk_offsets: np.ndarray) -> list["RoundChains"]:
        """The chains of every round of a layer's calls (in order). cu_seqlens, chunk_offsets [P+1]: every piece of
        every call, call after call, as one packed sequence of the calls' rows, with fla's chunk offsets
        (`CoreCalls.cu_seqlens`, `.chunk_offsets`). Refuses calls where a later piece does not start from its previous
        piece's entry."""
        first_piece = offsets([c.num_sequences for c in calls])
        by_round: dict[int, list[int]] = {}
        for j, call in enumerate(calls):
            by_round.setdefault(call.round, []).append(j)
        return [RoundChains._of_round(calls, js, first_piece, cu_seqlens, chunk_offsets) for js in by_round.values()]

    @staticmethod
    def _of_round(calls, js, first_piece, cu_seqlens, chunk_offsets) -> "RoundChains":
        chains: dict[int, list[tuple[int, int, int, int]]] = {}
        init: dict[int, int] = {}
        for j in js:
            call = calls[j]
            for n, s in enumerate(call.sequence.tolist()):
                chain = chains.setdefault(s, [])
                start = int(call.init_state[n])
                if chain:
                    assert start == chain[-1][3], \
                        "a call's piece continues its sequence from the previous piece's state"
                else:
                    init[s] = start
                g = int(first_piece[j]) + n
                chain.append((int(cu_seqlens[g]), int(cu_seqlens[g + 1]), int(chunk_offsets[g]),
                              int(call.first_state) + n))
        order = sorted(chains)
        flat = np.array([p for s in order for p in chains[s]], dtype=np.int64).reshape(-1, 4)
        entries = np.array([init[s] for s in order], dtype=np.int64)
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
        return RoundChains(
            pieces=as_t(offsets([len(chains[s]) for s in order])), piece_bos=as_t(flat[:, 0]),
            piece_eos=as_t(flat[:, 1]), piece_boh=as_t(flat[:, 2]), piece_state=as_t(flat[:, 3]), init=as_t(entries),
            grad_entries=table_entries(entries),
        )


def table_entries(entries: np.ndarray) -> torch.Tensor | slice | None:
    """How to read state-table entries `entries` [N] (and add gradients to them): None when all are entry 0 (zeros),
    a slice when they are one increasing run (a view, and one add), else an int64 index tensor (a gather, and a
    sorted, deterministic accumulation)."""
    if not entries.any():
        return None
    start = int(entries[0])
    if np.array_equal(entries, np.arange(start, start + entries.size)):
        return slice(start, start + entries.size)
    return torch.as_tensor(np.ascontiguousarray(entries), dtype=torch.int64)
