"""The policy's weights as Hugging Face checkpoint tensors, gathered one parameter at a time and packed into bounded
buckets: the weight sync from the trainer's FSDP2 / TP / EP shards into a rollout engine, with no full copy.

    for every state-dict entry (the same order on every rank):
        full_tensor()        a collective over the entry's mesh (FSDP2 all-gather, TP / EP gathers), on the device
        models.hf_io.key_rule(...).split    on-disk names and views (e.g. the experts' `[E, 2F, D]` -> 2E `[F, D]`)
    a bucket is yielded when the next entry would take it past `bucket_bytes` (an entry larger than that is a bucket
    of its own)

Every rank takes part in every gather and receives every full tensor: each rank's (or TP group's) engine loads the
same weights. The gathered memory alive at once is the bucket being filled plus the entry being gathered, at most
`bucket_bytes` + the largest entry, as long as the consumer lets go of a bucket before asking for the next one:
`pairs` empties each bucket as it yields from it. A plain (unwrapped) model streams the same way without
collectives. Under pipeline parallelism (`pp_group`) a rank holds only its stages' entries: the entry's owner gathers
it, then broadcasts it to the other ranks of its pp group, in the whole model's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.hf_io import key_rule

__all__ = ["Bucket", "hf_buckets", "pairs"]


@dataclass
class Bucket:
    """Consecutive on-disk tensors of the policy: `tensors` ((name, tensor) pairs, views of the gathered entries)
    and `nbytes`, the bytes of those entries."""

    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a state-dict entry (gathered from its shards), detached."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _stage_entries(model: nn.Module, config: ModelConfig, device: torch.device,
                   pp_group) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, whole tensor) of every entry of the whole model, in its order, on every rank of `pp_group`: gathered by
    the pp rank whose stages hold it, broadcast from there."""
    local = model.state_dict()
    owners: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(owners, sorted(local), group=pp_group)
    owner = {key: rank for rank, keys in enumerate(owners) for key in keys}
    with torch.device("meta"):
        whole = HybridForCausalLM(config).state_dict()
    me = dist.get_rank(pp_group)
    for key, ref in whole.items():
        if owner[key] == me:
            full = _full(local[key]).contiguous()
        else:
            full = torch.empty(ref.shape, dtype=ref.dtype, device=device)
        dist.broadcast(full, group=pp_group, group_src=owner[key])
        yield key, full


def hf_buckets(model: nn.Module, config: ModelConfig, bucket_bytes: int, pp_group=None,
               device: torch.device | None = None) -> Iterator[Bucket]:
    """The weights of `model` (a HybridForCausalLM, plain or wrapped by FSDP2 / TP / EP) in Hugging Face checkpoint
    names and layout (`models.hf_io.checkpoint_tensors`' names), in buckets of at most `bucket_bytes` (or one entry).

    Args:
        model: the policy; every rank of its meshes must consume the buckets in step (the gathers are collectives).
        config: its architecture (the on-disk names depend on it, e.g. Kimi-Linear's `block_sparse_moe.`).
        bucket_bytes: the most bytes of gathered entries a bucket holds (>= 1).
        pp_group: the pipeline group of a model of pipeline stages (None: `model` holds every entry).
        device: where entries of other stages are received (with `pp_group`).
    """
    if bucket_bytes < 1:
        raise ValueError(f"`bucket_bytes` must be >= 1, got {bucket_bytes}")
    if pp_group is None:
        entries = ((key, _full(tensor)) for key, tensor in model.state_dict().items())
    else:
        entries = _stage_entries(model, config, device, pp_group)
    bucket = Bucket([], 0)
    for key, full in entries:
        nbytes = full.numel() * full.element_size()
        if bucket.tensors and bucket.nbytes + nbytes > bucket_bytes:
            yield bucket
            bucket = Bucket([], 0)
        rule = key_rule(config, key, full.shape)
        bucket.tensors.extend(zip(rule.disk_keys, rule.split(full)))
        bucket.nbytes += nbytes
        del full
    if bucket.tensors:
        yield bucket


def pairs(buckets: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `buckets` in order, each bucket emptied as it is read, so that a bucket's memory
    is free (once the consumer drops the pairs) before the next bucket is gathered."""
    for bucket in buckets:
        tensors, bucket.tensors = bucket.tensors, []
        tensors.reverse()
        while tensors:
            yield tensors.pop()
