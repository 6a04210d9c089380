"""Row gathers that are (almost) permutations, with a backward that gathers too.

Legend: R rows of the source, T gathered rows, U source rows never read, M repeated reads.

`x[index]`'s autograd backward allocates a zero `[R, ...]` tensor and scatter-adds the gradient into it through a sort.
The linear-attention rounds read every physical row once in another order, and the few replay rows a second time;
their kept outputs are each read once. For such an index the gradient of row r is the gradient at one position that
reads it plus the gradients of its repeated reads. Backward then is one gather, a small fill and a
small scatter-add, together cheaper than the zero fill and sorted scatter-add of `x[index]`'s backward
(bench/RESULTS.md, "Profiled costs behind design choices").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.tree.regions import region

__all__ = ["RowGather"]


@dataclass
class RowGather:
    """`x[index]` for a source of R rows, as an autograd op whose backward is a gather.

    index [T]: source row of each gathered row. first [R]: a position reading each source row (0 for unread rows).
    unread [U]: source rows no position reads (zero gradient). repeat_pos [M], repeat_row [M]: the other positions,
    and the rows they read.
    """

    index: torch.Tensor
    first: torch.Tensor
    unread: torch.Tensor
    repeat_pos: torch.Tensor
    repeat_row: torch.Tensor

    @staticmethod
    def build(index: np.ndarray, rows: int) -> "RowGather":
        """From a host index [T] into a source of `rows` rows (host tensors: `models.tree.device_copy.to_device`
        moves them)."""
        index = np.asarray(index, dtype=np.int64)
        read, first_pos = np.unique(index, return_index=True)
        first = np.zeros(rows, dtype=np.int64)
        first[read] = first_pos
        unread = np.ones(rows, dtype=bool)
        unread[read] = False
        repeat = np.ones(index.size, dtype=bool)
        repeat[first_pos] = False
        repeat_pos = np.flatnonzero(repeat)
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64)  # noqa: E731
        return RowGather(as_t(index), as_t(first), as_t(np.flatnonzero(unread)), as_t(repeat_pos),
                         as_t(index[repeat_pos]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[R, ...]` -> `[T, ...]`."""
        return _RowGatherFunction.apply(x, self)


class _RowGatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather: RowGather):
        ctx.gather = gather
        with region("row gather"):
            return x[gather.index]

    @staticmethod
    def backward(ctx, grad):
        g: RowGather = ctx.gather
        with region("row gather backward"):
            dx = grad[g.first]
            if g.unread.numel():
                dx.index_fill_(0, g.unread, 0)
            if g.repeat_pos.numel():
                dx.index_put_((g.repeat_row,), grad[g.repeat_pos], accumulate=True)
        return dx, None
