"""The job configuration: one TOML section per concern, each a typed dataclass.

`configs/*.toml` set only what differs from these defaults. Paths in a config file (inputs and outputs) are relative
to that file. Sections that belong to another package reuse its dataclass: `[rollout]` extends
`rollout.config.RolloutConfig`, `[rl]` extends `app.losses.PolicyLossConfig`, `[parallel]` is
`parallel.config.ParallelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from app.config_loader import ConfigError
from app.data.config import DataConfig
from app.losses import PolicyLossConfig
from parallel.config import ParallelConfig
from rollout.config import RolloutConfig

__all__ = ["JobConfig", "ConfigError"]


@dataclass(kw_only=True)
class JobSection:
    kind: Literal["rl", "plan"] = "rl"
    """"rl": the agentic RL loop (rollout trees -> tree training -> weight sync). "plan": pack `rollout.trajectories`
    (or the bundled sample trees) and report what tree training saves on them."""


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "tiny-qwen3-next"
    """Model architecture preset (models/presets.py), randomly initialised from `train.seed`; ignored when
    `hf_path` is set."""
    vocab_size: int | None = None
    """Override of the preset's vocabulary size; presets use the character tokenizer (rollout/tokenizer.py), padded
    to this size (at least 106)."""
    hidden_size: int | None = None
    """Override of the preset's model width D (head counts and head dims stay)."""
    hf_path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + safetensors + tokenizer) to start from instead."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Parameter dtype of the trainer (master weights and optimizer states). The rollout engine has its own dtype
    (`rollout.vllm.dtype`)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"`model.{name}` must be >= 1 or unset, got {value}")


@dataclass(kw_only=True)
class VLLMSection:
    """Settings of the vLLM engine (rollout.vllm_engine.VLLMEngineConfig without the model path, which the app fills
    with an export of the current policy)."""

    dtype: str = "bfloat16"
    """Serving dtype; hybrid GDN/KDA models need "bfloat16" on CPU."""
    kv_cache_memory_bytes: int | None = None
    """KV/state cache bytes; required on CPU (e.g. 67108864), None on GPUs = from gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take when kv_cache_memory_bytes is unset (the trainer needs the rest)."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster startup, slower decoding (true on CPU)."""
    prefix_match_unit: int | None = None
    """Token granularity of prefix-cache hits for hybrid models (e.g. 16 on GPUs)."""


@dataclass(kw_only=True)
class RolloutSection(RolloutConfig):
    """The branching policy (RolloutConfig's fields), the engine and the environment."""

    engine: Literal["vllm", "torch"] = "vllm"
    """"vllm": vLLM (rollout.vllm_engine; in a child process of rank 0 under torchrun, rollout.vllm_process). "torch":
    the trainer's own model decoding without a KV cache (app/torch_engine.py): slow, exact, and reproducible with
    `rollout.seed` (tests, machines without vLLM)."""
    env: str = "calculator"
    """Environment: a built-in name ("calculator") or "package.module:Class" (a rollout.envs.Environment)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor, e.g. {num_operations = 1, max_operand = 3}."""
    tasks_per_step: int = 8
    """Rollout trees per RL step (one task each)."""
    max_model_len: int = 1024
    """Longest prompt + generation the engine accepts; longer paths end with end="context_full"."""
    engine_seed: int = 0
    """Seed of the engine's own sampling generator (used by requests without a seed, i.e. `seed` unset)."""
    trajectories: str | None = None
    """`[job] kind = "plan"` only: a TRAJ.jsonl file (planner/jsonl.py) to report on instead of the bundled sample."""
    vllm: VLLMSection = field(default_factory=VLLMSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tasks_per_step < 1:
            raise ConfigError(f"`rollout.tasks_per_step` must be >= 1, got {self.tasks_per_step}")

    def branching(self) -> RolloutConfig:
        """The RolloutConfig part of this section."""
        return RolloutConfig(**{f.name: getattr(self, f.name) for f in fields(RolloutConfig)})


@dataclass(kw_only=True)
class PlannerConfig:
    capacity: int = 65536
    """Microbatch capacity T: unique compact tokens per microbatch (HARTS §3.2)."""
    chunk_size: int | None = None
    """Linear-attention chunk size B the call planner aligns replay to (HARTS §3.3); unset = the model's. A value
    that differs from the model's is an error."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ConfigError(f"`planner.capacity` must be >= 1, got {self.capacity}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(f"`planner.chunk_size` must be >= 1, got {self.chunk_size}")


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 0
    """Seed of parameter initialisation and task sampling (task sets are derived per step, so resumes see the
    same tasks)."""
    steps: int = 20
    """RL steps (one rollout batch and `rl.epochs` optimizer steps each)."""
    lr: float = 1e-4
    """AdamW peak learning rate of the RL phase."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps) at the start of each phase."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    sft_steps: int = 0
    """Supervised warm-up steps on tree-structured demonstrations (the environment's own solutions) before RL."""
    sft_lr: float | None = None
    """Peak learning rate of the SFT warm-up; unset = `lr`."""
    sft_tasks_per_step: int = 16
    """Demonstration trees per SFT step."""
    moe_aux_loss_coef: float = 1e-3
    """Coefficient of the MoE load-balancing loss (router statistics weighted by multiplicities)."""
    moe_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss."""
    expert_bias_rate: float = 1e-3
    """Aux-loss-free balancing step of models with expert biases (Kimi-Linear); 0 = off."""
    attention_backend: Literal["dense", "flex", "branch"] = "dense"
    """Tree full-attention backend (models/tree/attention.py): "dense" is the O(C^2)-memory reference for CPUs;
    "branch" (HARTS's packed Q/KV views, flash kernel in bf16) on GPUs; "flex" (FlexAttention, O(C) mask) measured
    2.4x slower than "branch" on an H200 (bench/RESULTS.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; "auto" = cuda when available."""
    threads: int | None = None
    """torch intra-op threads of the trainer (unset = torch's default)."""

    def __post_init__(self) -> None:
        for name in ("steps", "sft_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`train.{name}` must be >= 0, got {getattr(self, name)}")
        if self.sft_tasks_per_step < 1:
            raise ConfigError(f"`train.sft_tasks_per_step` must be >= 1, got {self.sft_tasks_per_step}")
        for name in ("lr", "sft_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"`train.{name}` must be > 0, got {value}")
        if self.grad_clip < 0:
            raise ConfigError(f"`train.grad_clip` must be >= 0 (0 = off), got {self.grad_clip}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"`train.threads` must be >= 1 or unset, got {self.threads}")


@dataclass(kw_only=True)
class RLConfig(PolicyLossConfig):
    """The policy objective (PolicyLossConfig's fields) and how advantages are formed."""

    advantages: Literal["tree", "siblings"] = "tree"
    """GRPO grouping (app/advantages.py): each trajectory against its tree, or each branch against its siblings."""
    scale_by_std: bool = True
    """Divide GRPO advantages by the group's reward std."""
    epochs: int = 1
    """Optimizer steps per rollout batch. Above 1 the ratio is taken against the old log-probs, scored by the trainer
    before the first update, and clipping matters (PPO)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs < 1:
            raise ConfigError(f"`rl.epochs` must be >= 1, got {self.epochs}")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = "outputs/checkpoints"
    """Where checkpoints are written (one folder per step, written atomically)."""
    interval: int = 10
    """Checkpoint every this many steps (SFT and RL steps count alike), and at the end; 0 = only at the end."""
    keep: int = 2
    """Newest checkpoints kept."""
    resume: bool = False
    """Continue from the newest checkpoint in `dir` (also `--resume`). Without it, a run starts fresh and removes
    the checkpoints in `dir`."""
    export_dir: str | None = "outputs/hf"
    """Hugging Face export of the final policy (config.json, safetensors, tokenizer); unset = none."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"`checkpoint.interval` must be >= 0, got {self.interval}")
        if self.keep < 1:
            raise ConfigError(f"`checkpoint.keep` must be >= 1, got {self.keep}")


@dataclass(kw_only=True)
class MetricsConfig:
    log_dir: str = "outputs/tb"
    """TensorBoard log directory; each fresh run writes a new subfolder, a resumed run continues its own."""
    tree_picture_interval: int = 5
    """Draw one rollout tree into TensorBoard every this many RL steps (0 = never)."""
    progress: bool = True
    """Show rich progress bars."""

    def __post_init__(self) -> None:
        if self.tree_picture_interval < 0:
            raise ConfigError(f"`metrics.tree_picture_interval` must be >= 0, got {self.tree_picture_interval}")


@dataclass(kw_only=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataConfig = field(default_factory=DataConfig)
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
        self.data.resolve_paths(base)
        if self.model.hf_path is not None:
            path = (base / self.model.hf_path).resolve()
            if not (path / "config.json").is_file():
                raise ConfigError(f"`model.hf_path`: {path} is not a Hugging Face checkpoint (no config.json)")
            self.model.hf_path = str(path)
        self.checkpoint.dir = str((base / self.checkpoint.dir).resolve())
        if self.checkpoint.export_dir is not None:
            self.checkpoint.export_dir = str((base / self.checkpoint.export_dir).resolve())
        self.metrics.log_dir = str((base / self.metrics.log_dir).resolve())
