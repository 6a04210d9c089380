"""The rollout engine of a job, started from the trainer's current weights.

vLLM starts from a folder holding only config.json and the tokenizer (`load_format="dummy"`, random weights) and
then receives the policy through `update_weights`, the same path every later step takes; nothing is written but the
config. vLLM logs only errors unless VLLM_LOGGING_LEVEL is set (its warnings repeat every weight reload: fp32 tensors
cast to bf16, "RotaryEmbedding: Failed to load weights" for a layer without weights).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from app.config import RolloutSection
from app.torch_engine import TorchEngine
from models.decoder import HybridForCausalLM
from models.hf_config import config_to_hf
from models.hf_io import checkpoint_tensors
from rollout.engine import Engine

__all__ = ["build_engine"]


def _vllm_engine(section: RolloutSection, model: HybridForCausalLM, tokenizer) -> Engine:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig
    from rollout.vllm_process import VLLMProcessEngine

    # Under torchrun (rank 0) an in-process engine would join the trainers' process group and hang: spawn it instead.
    engine_class = VLLMProcessEngine if torch.distributed.is_initialized() else VLLMEngine
    v = section.vllm
    with tempfile.TemporaryDirectory(prefix="arbor-engine-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
        tokenizer.save_pretrained(folder)
        engine = engine_class(
            VLLMEngineConfig(
                model=folder, dtype=v.dtype, max_model_len=section.max_model_len,
                kv_cache_memory_bytes=v.kv_cache_memory_bytes, gpu_memory_utilization=v.gpu_memory_utilization,
                load_format="dummy", seed=section.engine_seed, enforce_eager=v.enforce_eager,
                prefix_match_unit=v.prefix_match_unit, options=dict(v.options),
            )
        )
    engine.update_weights(checkpoint_tensors(model))
    return engine


def build_engine(section: RolloutSection, model: HybridForCausalLM, tokenizer) -> Engine:
    """An engine of kind `section.engine` holding `model`'s current weights. Raises EngineError if it cannot start."""
    if section.engine == "torch":
        return TorchEngine(model, max_model_len=section.max_model_len, seed=section.engine_seed)
    return _vllm_engine(section, model, tokenizer)
