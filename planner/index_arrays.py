"""Index-array primitives of the planner: the offsets of consecutive ranges, the inverse of a permutation and the
floor(log2) that picks a sparse-table level.

Legend: N ranges or positions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["offsets", "inverse_permutation", "floor_log2"]


def offsets(lengths) -> np.ndarray:
    """[N+1] int64 exclusive prefix sums: range i of consecutive ranges of `lengths` [N] is [out[i], out[i+1])."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """[N] int64 `inv` with inv[perm[i]] = i, for a permutation `perm` [N] of 0 .. N-1."""
    inv = np.empty(perm.size, dtype=np.int64)
    inv[perm] = np.arange(perm.size)
    return inv


def floor_log2(x: np.ndarray) -> np.ndarray:
    """floor(log2(x)) [int64] for int arrays x >= 1 (exact for x < 2**53)."""
    return (np.frexp(x.astype(np.float64))[1] - 1).astype(np.int64)
