"""The job configuration: one TOML section per concern, each a typed dataclass.

`configs/*.toml` set only what differs from these defaults. Paths in a config file are relative to that file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from app.config_loader import ConfigError

__all__ = ["JobConfig", "ConfigError"]


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "tiny-qwen3-next"
    """Model architecture preset (see models/README.md); ignored when `hf_path` is set."""
    hf_path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + safetensors) to load instead of a random preset."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Parameter and activation dtype."""


@dataclass(kw_only=True)
class RolloutConfig:
    trajectories: str | None = None
    """Offline rollouts: a TRAJ.jsonl file (planner/jsonl.py) used instead of generating trees."""


@dataclass(kw_only=True)
class PlannerConfig:
    capacity: int = 65536
    """Microbatch capacity T: unique compact tokens per microbatch (HARTS §3.2)."""
    chunk_size: int = 64
    """Linear-attention chunk size B; the call planner aligns replay to it (HARTS §3.3)."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ConfigError(f"`planner.capacity` must be >= 1, got {self.capacity}")
        if self.chunk_size < 1:
            raise ConfigError(f"`planner.chunk_size` must be >= 1, got {self.chunk_size}")


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 0
    """Seed for parameter initialisation and sampling."""


@dataclass(kw_only=True)
class RLConfig:
    loss: Literal["grpo", "ppo"] = "grpo"
    """Policy objective over per-token log-probabilities."""


@dataclass(kw_only=True)
class ParallelConfig:
    dp: int = 1
    """Data-parallel degree D: the planner makes K microbatches with K mod D = 0."""

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ConfigError(f"`parallel.dp` must be >= 1, got {self.dp}")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = "outputs/checkpoints"
    """Where checkpoints are written (relative to the config file)."""


@dataclass(kw_only=True)
class MetricsConfig:
    log_dir: str = "outputs/tb"
    """TensorBoard log directory (relative to the config file)."""


@dataclass(kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def resolve_paths(self, base: Path) -> None:
        """Make file paths absolute relative to the config file's folder, and check the inputs exist."""
        if self.rollout.trajectories is not None:
            path = (base / self.rollout.trajectories).resolve()
            if not path.is_file():
                raise ConfigError(f"`rollout.trajectories`: file {path} does not exist")
            self.rollout.trajectories = str(path)
        if self.model.hf_path is not None:
            path = (base / self.model.hf_path).resolve()
            if not (path / "config.json").is_file():
                raise ConfigError(f"`model.hf_path`: {path} is not a Hugging Face checkpoint (no config.json)")
            self.model.hf_path = str(path)
        self.checkpoint.dir = str((base / self.checkpoint.dir).resolve())
        self.metrics.log_dir = str((base / self.metrics.log_dir).resolve())
