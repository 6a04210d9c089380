"""The index arrays of a layer's packed KDA kernel calls, as the fla path takes them (`models.ops.kda.tree_calls`):
per call, fla's varlen bookkeeping and the state-table entries its sequences start from; per round, each sequence's
pieces as one chain for the chain kernels (`models.ops.kda.chains`). Built on the host by the caller (tree execution:
`models.tree.layout`), moved to the device once, read by every layer.

Legend: N_j sequences of call j, N_r sequences of round r, P_r their pieces, NT_j call j's chunks.

The state table these entries index: entry 0 zeros, entries 1..Y states from outside, then every call's final
states in call order (call j's first at 1 + Y + the pieces of the calls before it), so a call reads only entries
written before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CallArrays", "ChainArrays"]


@dataclass
class CallArrays:
    """One varlen call of fla's recurrences (the call-by-call path, `models.ops.kda.recurrence`)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    """[N_j+1] int64 sequence boundaries in the call's rows, on the device and on the host (fla needs no host sync
    then)."""
    chunk_indices: torch.Tensor
    """`[NT_j, 2]` fla's chunk indices of `cu_seqlens` (`models.ops.delta_rule.fla_args.fla_chunk_arrays`)."""
    init_entries: torch.Tensor | slice | None
    """The table entries its sequences start from: a slice where they are one run (a view, and one add of their
    gradients), else an int64 index `[N_j]` (a gather, and a sorted add); None when all start from zeros."""


@dataclass
class ChainArrays:
    """One round's sequences as chains of pieces (int64 tensors; the chain kernels' arguments of the same names)."""

    pieces: torch.Tensor
    """[N_r+1] each sequence's pieces (CSR over the piece arrays), in call order."""
    piece_bos: torch.Tensor
    piece_eos: torch.Tensor
    """[P_r] the piece's rows among the layer's calls' rows."""
    piece_boh: torch.Tensor
    """[P_r] the piece's first chunk among the calls' chunks (fla's order: call after call)."""
    piece_state: torch.Tensor
    """[P_r] the table entry of the state after the piece."""
    init: torch.Tensor
    """[N_r] the table entry each sequence starts from (0 holds zeros)."""
    grad_entries: torch.Tensor | slice | None
    """`init` as `CallArrays.init_entries` reads entries, for the sequences' initial-state gradients."""

    @property
    def num_sequences(self) -> int:
        """N_r (the launch grid)."""
        return self.init.shape[0]
