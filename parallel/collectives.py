"""Differentiable collectives for tensor and expert parallelism (Megatron's f / g, and an all-to-all of rows).

Legend: M rows, D row width.

Inside a tensor-parallel region every rank holds the same input rows and a slice of the heads (or FFN width):
  f = `copy_to_group`:     forward identity,  backward all-reduce   (entry: the input's gradient is a sum of slices)
  g = `reduce_from_group`: forward all-reduce, backward identity    (exit: the output is a sum of slices)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["copy_to_group", "reduce_from_group", "all_to_all_rows"]


class CopyToGroupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous().clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class ReduceFromGroupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class AllToAllRowsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, send_splits, recv_splits, group):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        return _all_to_all(x_MD, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, dy_MD):
        return _all_to_all(dy_MD, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _all_to_all(x_MD, send_splits, recv_splits, group):
    x_MD = x_MD.contiguous()
    out = x_MD.new_empty((sum(recv_splits), *x_MD.shape[1:]))
    dist.all_to_all_single(out, x_MD, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                           group=group)
    return out


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """f: identity forward; the gradient is summed over `group` in backward."""
    return CopyToGroupFunction.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """g: the sum of `x` over `group` in forward; the gradient passes unchanged."""
    return ReduceFromGroupFunction.apply(x, group)


def all_to_all_rows(
    x_MD: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows `[M, ...]` -> rows `[sum(recv_splits), ...]`: the first send_splits[0] rows go to rank 0 of `group`, the
    next send_splits[1] to rank 1, ...; received blocks are concatenated by source rank. Backward sends gradients
    back the same way."""
    return AllToAllRowsFunction.apply(x_MD, tuple(send_splits), tuple(recv_splits), group)
