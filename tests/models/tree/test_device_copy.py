"""`models.tree.device_copy`: the views of one buffer (values, shapes, dtypes, alignment) and `to_device`'s walk
through a layout."""

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from models.tree.device_copy import ALIGN_BYTES, device_views, to_device


def test_views_hold_the_tensors_each_aligned_in_one_buffer_per_dtype():
    tensors = [torch.arange(5), torch.arange(6, dtype=torch.int32).view(3, 2), torch.zeros(0, dtype=torch.int64),
               torch.tensor([[7, 8], [9, 10]]), torch.arange(3, dtype=torch.int32)]
    views = device_views(tensors, None)
    for t, v in zip(tensors, views):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t) and v.is_contiguous()
        assert v.data_ptr() % ALIGN_BYTES == 0 or v.numel() == 0
    int64 = [v for v in views if v.dtype == torch.int64]
    assert len({v.untyped_storage().data_ptr() for v in int64}) == 1
    assert views[1].untyped_storage().data_ptr() == views[4].untyped_storage().data_ptr()
    assert device_views([], None) == []


class Pair(NamedTuple):
    slot: int
    rows: torch.Tensor


@dataclass
class Inner:
    index: torch.Tensor
    index_cpu: torch.Tensor
    part: slice


@dataclass
class Outer:
    inner: list[Inner]
    links: dict[str, list[Pair]]
    weight: torch.Tensor
    maybe: torch.Tensor | None
    cached: object = field(default=None, init=False)


def test_to_device_moves_every_tensor_of_a_layout_but_host_fields_in_one_buffer_per_dtype():
    cu = torch.tensor([0, 3, 5])
    layout = Outer([Inner(torch.arange(4), cu, slice(1, 3)), Inner(cu, cu, slice(0, 0))],
                   {"state": [Pair(2, torch.tensor([7, 8]))]}, torch.ones(3, dtype=torch.float64), None)
    layout.cached = "built on first use"
    moved = to_device(layout, "meta")
    tensors = [moved.inner[0].index, moved.inner[1].index, moved.links["state"][0].rows, moved.weight]
    assert all(t.device.type == "meta" for t in tensors)
    assert [t.shape for t in tensors] == [(4,), (3,), (2,), (3,)] and moved.weight.dtype == torch.float64
    assert all(i.index_cpu is cu for i in moved.inner)  # host fields stay
    assert moved.inner[0].part == slice(1, 3) and moved.links["state"][0].slot == 2 and moved.maybe is None
    assert isinstance(moved.links["state"][0], Pair) and moved.cached is None and layout.inner[0].index.is_cpu
    host = to_device(layout, None)
    assert torch.equal(host.inner[0].index, torch.arange(4)) and torch.equal(host.links["state"][0].rows,
                                                                            torch.tensor([7, 8]))
    assert host.inner[0].index.untyped_storage().data_ptr() == host.inner[1].index.untyped_storage().data_ptr()
