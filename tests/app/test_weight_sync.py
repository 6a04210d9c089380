"""The weight sync (app.weight_sync over parallel.weight_stream) from FSDP2 x EP and FSDP2 x TP shards on CPU ranks
(gloo) into every rank's torch engine: after the sync each engine holds exactly the trainer's weights (float64,
bitwise: a gather copies), and the memory the sync allocates and holds at once stays within a bucket plus a few of
the largest entry (the gathered entry, and the receiver's merge of the experts' per-expert matrices: two halves and
their concatenation), far below the model; the old path (a full CPU state dict on rank 0) allocates the whole model,
which the same tracker sees."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from app.torch_engine import TorchEngine
from app.weight_sync import sync_weights
from bench.live_bytes import LiveBytes
from models.decoder import HybridForCausalLM
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job
from tests.parallel.harness import run_ranks, small_config

#: The bucket as a fraction of the model's bytes: small enough that a full copy could not pass the bound.
BUCKET_FRACTION = 8
#: Largest entries alive beside a bucket: the one being gathered, and the receiver's merge (two halves + result).
LARGEST_ENTRIES = 3


def entry_bytes(model: HybridForCausalLM) -> list[int]:
    return [t.numel() * t.element_size() for t in model.state_dict().values()]


def sync_into_engines(preset: str, layout: dict) -> None:
    config = small_config(preset)
    torch.manual_seed(0)
    reference = HybridForCausalLM(config)
    model = parallelize_for_job(copy.deepcopy(reference), init_distributed(ParallelConfig(**layout), "cpu"))
    torch.manual_seed(1)
    engine = TorchEngine(HybridForCausalLM(config), max_model_len=64)
    sizes = entry_bytes(reference)
    total, largest = sum(sizes), max(sizes)
    bucket = total // BUCKET_FRACTION
    with LiveBytes() as memory:
        stats = sync_weights(engine, model, config, bucket)
    assert stats.nbytes == total
    want, got = reference.state_dict(), engine.model.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    bound = bucket + LARGEST_ENTRIES * largest
    rank = dist.get_rank()
    print(f"rank {rank} {preset} {layout}: sync peak {memory.peak} B allocated and alive; bucket {bucket} B, largest "
          f"entry {largest} B, bound {bound} B, model {total} B")
    assert 0 < memory.peak <= bound < total
    with LiveBytes() as old:
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        print(f"rank 0: the full-state-dict path's peak {old.peak} B")
        assert old.peak >= total


def test_sync_from_fsdp_x_ep_shards_is_exact_and_bounded():
    """qwen3-next: FSDP2 over 2 ranks, routed experts sharded 2-way by expert parallelism."""
    run_ranks(2, sync_into_engines, "tiny-qwen3-next", {"dp_shard": 2, "ep": 2})


def test_sync_from_fsdp_x_tp_shards_is_exact_and_bounded():
    """kimi-linear (per-expert w1/w3/w2, `block_sparse_moe.`, split q/k/v convs): FSDP2 2 x TP 2 on 4 ranks."""
    run_ranks(4, sync_into_engines, "tiny-kimi-linear", {"dp_shard": 2, "tp": 2})


class Recording(TorchEngine):
    """A torch engine that records the sync's calls (sleep and wake are vLLM's; CUDA only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def update_weights(self, named_tensors) -> None:
        self.calls.append(("update_weights",))
        super().update_weights(named_tensors)

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))


def test_a_sleeping_engine_wakes_its_kv_cache_only_after_the_weights_are_in():
    config = small_config("tiny-qwen3-next")
    model = HybridForCausalLM(config)
    for asleep, calls in ((False, [("update_weights",)]),
                          (True, [("update_weights",), ("wake_up", ["kv_cache", "scheduling"])])):
        engine = Recording(HybridForCausalLM(config), max_model_len=64)
        sync_weights(engine, model, config, 2**20, asleep=asleep)
        assert engine.calls == calls
        assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), model.state_dict().values()))
