"""parallel.weight_stream on a plain model: the buckets hold exactly `models.hf_io.checkpoint_tensors`' (name,
tensor) pairs, in order; a bucket holds at most `bucket_bytes` unless one entry alone is larger; `pairs` empties each
bucket as it reads it. (The gathers from FSDP2 / TP / EP shards and the memory bound: tests/app/test_weight_sync.py;
pipeline stages: tests/app/test_distributed.py.)"""

from __future__ import annotations

import pytest
import torch

from models.decoder import HybridForCausalLM
from models.hf_io import checkpoint_tensors
from parallel.weight_stream import hf_buckets, pairs
from tests.parallel.harness import small_config


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-kimi-linear"])
@pytest.mark.parametrize("bucket_bytes", [1, 5000, 10**9])
def test_buckets_hold_the_checkpoint_tensors_in_order(preset, bucket_bytes):
    torch.manual_seed(0)
    model = HybridForCausalLM(small_config(preset))
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    buckets = list(hf_buckets(model, model.config, bucket_bytes))
    got = [pair for bucket in buckets for pair in bucket.tensors]
    want = list(checkpoint_tensors(model))
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert sum(b.nbytes for b in buckets) == sum(sizes)
    assert all(b.nbytes <= bucket_bytes or b.nbytes in sizes for b in buckets)
    if bucket_bytes == 1:
        assert len(buckets) == len(sizes)
    if bucket_bytes == 10**9:
        assert len(buckets) == 1


def test_pairs_empty_each_bucket_as_they_read_it():
    model = HybridForCausalLM(small_config("tiny-qwen3-next"))
    buckets = list(hf_buckets(model, model.config, 5000))
    stream = pairs(buckets)
    first_bucket = len(buckets[0].tensors)
    for _ in range(first_bucket):
        next(stream)
    assert buckets[0].tensors == [] and buckets[1].tensors, "the first bucket is let go once read"
    assert len(list(stream)) == sum(1 for _ in checkpoint_tensors(model)) - first_bucket


def test_bucket_bytes_must_be_positive():
    model = HybridForCausalLM(small_config("tiny-qwen3-next"))
    with pytest.raises(ValueError, match=r"`bucket_bytes` must be >= 1, got 0"):
        next(hf_buckets(model, model.config, 0))
