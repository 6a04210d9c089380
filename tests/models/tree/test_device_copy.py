"""`models.tree.device_copy.device_views`: values, shapes, dtypes and alignment of the views of one buffer."""

import torch

from models.tree.device_copy import ALIGN_BYTES, device_views


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
