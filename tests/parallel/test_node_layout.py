"""The launch configs: their [parallel] sections are valid layouts for their models, and configs/node-8gpu.toml's
layout runs on 8 CPU ranks (gloo) with the tiny Kimi-Linear architecture (KDA + MLA, 8 experts) and matches the
single-process step (fp32). The 8-rank run is slow; test_expert_parallel.py covers the same path (FSDP2 + EP +
recomputation machinery) on 4 ranks."""

import tomllib
from pathlib import Path

import pytest

from models.presets import preset
from parallel.config import ParallelConfig
from tests.parallel.harness import compare_step, run_ranks

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def parallel_section(name: str) -> tuple[dict, dict]:
    with open(CONFIGS / name, "rb") as f:
        job = tomllib.load(f)
    return job["parallel"], job["model"]


@pytest.mark.parametrize("name, world_size", [("node-8gpu.toml", 8), ("multinode.toml", 16)])
def test_launch_configs_are_valid_layouts(name, world_size):
    parallel, model = parallel_section(name)
    config = ParallelConfig(**parallel).resolved(world_size)
    config.validate(preset(model["preset"]))
    assert config.dp * config.tp * config.pp == world_size


@pytest.mark.slow
def test_node_8gpu_layout_on_8_cpu_ranks():
    parallel, _ = parallel_section("node-8gpu.toml")
    recompute = parallel.pop("activation_checkpointing")
    # CPU simulation in fp32: no bf16 casts.
    parallel.update(param_dtype="model", reduce_dtype="model")
    run_ranks(8, compare_step, "tiny-kimi-linear", parallel, 192, 2, recompute, 8, "token-mean", "float32")
