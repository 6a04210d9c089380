"""How many processes a job needs, and the torchrun launch of one node when it needs more than one.

The launch size is the product of the `[parallel]` degrees, pp * dp_replicate * dp_shard * tp, where dp_shard = -1
("the rest of the world") counts as 1: a config meant for several ranks sets dp_shard (or another degree)
explicitly. `./run.sh CONFIG.toml` (python -m app) started outside torchrun with a size above 1 re-executes itself
as `python -m torch.distributed.run --standalone --nproc-per-node N -m app CONFIG ...` on this node, after checking
what the ranks will need: one CUDA GPU each (NCCL) when `train.device` resolves to cuda, nothing more on the CPU
(gloo), and pipeline support (`check_multi_rank`). Several nodes: start torchrun on each node yourself
(configs/multinode.toml shows the command); the ranks then see WORLD_SIZE and run without re-launching.
"""

from __future__ import annotations

import os
import sys

import torch

from app.config import JobConfig
from app.errors import ConfigError
from parallel.config import pipeline_support

__all__ = ["launch_size", "check_multi_rank", "torchrun_command", "under_torchrun"]


def launch_size(config: JobConfig) -> int:
    p = config.parallel
    return p.pp * p.dp_replicate * max(p.dp_shard, 1) * p.tp


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _device_type(config: JobConfig) -> str:
    """"cuda" or "cpu": what `train.device` resolves to on this machine."""
    name = config.train.device
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def check_multi_rank(config: JobConfig) -> None:
    """Raise ConfigError for what a job of several ranks cannot do."""
    reason = pipeline_support()
    if config.parallel.pp > 1 and reason is not None:
        raise ConfigError(f"`parallel.pp` = {config.parallel.pp}: {reason}; set pp = 1")


def torchrun_command(config: JobConfig, path: str, argv: list[str]) -> list[str]:
    """The command that starts this job on one node (raises ConfigError naming what is missing)."""
    check_multi_rank(config)
    n = launch_size(config)
    if _device_type(config) == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < n:
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise ConfigError(
                f"{path}: the [parallel] degrees need {n} ranks with `train.device` = "
                f"{config.train.device!r}, i.e. {n} CUDA GPUs on this node, one per rank (NCCL), but torch "
                f"{torch.__version__} ({build}) sees {gpus}. Needs: {n} GPUs and the GPU stack (the `gpu` extra of "
                "pyproject.toml: CUDA torch 2.14, fla kernels, triton >= 3.7.1); for several nodes start torchrun on "
                "each node (configs/multinode.toml). To simulate the layout on "
                f"{n} CPU ranks (gloo) instead, add --train.device=cpu and a small model, e.g. "
                "--model.preset=tiny-kimi-linear --parallel.param_dtype=model"
            )
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            "-m", "app", path, *argv]
