"""The host-built order of a segment sum: which source rows add to which target row, in which order.

Legend: A source rows (positions of a gather), U target rows that at least one position reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SegmentPlan"]


@dataclass
class SegmentPlan:
    """Sums of source rows per target row: target `rows[u]` receives source rows `order[offsets[u]:offsets[u+1]]`,
    in that order (increasing source position).

    rows [U]: target rows, increasing, each once; order [A]: source positions grouped by target; offsets [U+1]:
    each target's range in `order` (all int64)."""

    rows: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor

    @staticmethod
    def host_arrays(index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, order, offsets) of the gather `x[index]`'s gradient: position a adds to row index[a]."""
        index = np.asarray(index, dtype=np.int64)
        counts = np.bincount(index) if index.size else np.zeros(0, np.int64)
        rows = np.flatnonzero(counts)
        return rows, np.argsort(index, kind="stable"), np.concatenate([[0], np.cumsum(counts[rows])]).astype(np.int64)
