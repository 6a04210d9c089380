"""The weight sync of every RL step: the trainer's policy streamed into this rank's engine in place.

    engine.update_weights(pairs(buckets))                 a sleeping vLLM engine wakes its weights first (and only
                                                          them); then the engine's own loader (layerwise reload)
                                                          pulls the buckets, and the prefix cache is reset
    parallel.weight_stream.hf_buckets                     gathered on the device one parameter at a time, as the
                                                          loader pulls them (after the wake)
    wake the KV cache and scheduling (if asleep)          only once the weights are in

The order of the wakes follows vLLM's colocation examples: waking the KV cache before the sync can run out of memory
(vLLM issues 16663, 17117). Every rank runs the sync at the same time (the gathers are collectives), nothing is
written to a file, and besides the engine's own weights a rank holds at most a bucket, the parameter being gathered
and what the engine's loader keeps: the torch engine one parameter's parts and their merge (measured:
tests/app/test_weight_sync.py); vLLM's layerwise reload buffers the tensors of one of its layers until the layer is
complete (the parameters arrive in layer order, so about one layer, e.g. all experts of an MoE layer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from models.config import ModelConfig
from parallel.weight_stream import Bucket, hf_buckets, pairs
from rollout.engine import Engine

__all__ = ["SyncStats", "sync_weights"]


@dataclass
class SyncStats:
    """One sync on this rank: wall seconds (the wakes included) and the bytes handed to the engine."""

    seconds: float
    nbytes: int


def _counted(buckets: Iterator[Bucket], stats: SyncStats) -> Iterator[Bucket]:
    for bucket in buckets:
        stats.nbytes += bucket.nbytes
        yield bucket


def sync_weights(engine: Engine, model: nn.Module, config: ModelConfig, bucket_bytes: int, *,
                 asleep: bool = False, pp_group=None, device: torch.device | None = None) -> SyncStats:
    """Stream `model`'s weights (plain, FSDP2 / TP / EP shards, or pipeline stages with `pp_group`) into `engine` in
    buckets of at most `bucket_bytes`, in the trainer's dtype (the engine rounds to its own: some of vLLM's parameters
    stay fp32, so rounding here could lose what they keep). `asleep`: the engine sleeps at level 1 or 2 and is awake
    afterwards. Raises EngineError when the engine fails."""
    start = time.perf_counter()
    stats = SyncStats(0.0, 0)
    if asleep and device is not None and device.type == "cuda":
        # The trainer's freed blocks go back to the driver first: vLLM's weights wake into memory of their own.
        torch.cuda.empty_cache()
    buckets = _counted(hf_buckets(model, config, bucket_bytes, pp_group=pp_group, device=device), stats)
    engine.update_weights(pairs(buckets))
    if asleep:
        engine.wake_up(["kv_cache", "scheduling"])
    stats.seconds = time.perf_counter() - start
    return stats
