"""How one training job spreads a hybrid model over ranks: degrees, activation checkpointing, compile, precision.

Legend: W world size (ranks), D data-parallel replicas (the planner's DP degree), H heads, HV value heads,
E experts, V vocabulary.

Rank layout (outermost first): pp x dp_replicate x dp_shard x tp, with W = pp * dp_replicate * dp_shard * tp.
D = dp_replicate * dp_shard ranks hold different microbatches; the tp ranks of one replica hold the same rows.
Expert parallelism splits dp_shard x tp into efsdp x ep (ep innermost, torchtitan's layout), so the ep ranks of a
group hold different rows (tp ranks route different slices of their replica's rows in MoE layers), exchange routed
rows by all-to-all, and each keeps E / ep experts.

The app exposes these fields as the TOML section `[parallel]` (one key per field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from models.config import GatedAttentionConfig, GDNConfig, KDAConfig, MLAConfig, ModelConfig
from models.recompute import SelectiveRecompute

__all__ = ["ParallelConfig", "pipeline_support"]


def pipeline_support() -> str | None:
    """None if the installed torch runs `parallel.pipeline` (torch >= 2.14), else the reason it cannot."""
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 14):
        return (
            f"torch {torch.__version__} has no `step(arg_mbs=..., kwarg_mbs=...)` in torch.distributed.pipelining "
            "schedules (measured with torchtitan 0.3.0 on torch 2.13: 'Expecting 2 arg_mbs but got 1'), and tree "
            "microbatches need per-microbatch inputs; pipeline parallelism needs torch >= 2.14"
        )
    return None


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees and wrapping policy of `parallel.parallelize_hybrid`."""

    dp_replicate: int = 1
    """Replicas of the fully sharded model (HSDP: gradients all-reduced across them); across nodes in multi-node
    runs."""
    dp_shard: int = -1
    """Ranks one FSDP2 group shards parameters over; -1 = the rest of the world (W / (pp * dp_replicate * tp))."""
    tp: int = 1
    """Tensor-parallel degree: heads of every mixer, FFN width of dense and shared-expert MLPs, and the vocabulary
    of embeddings and LM head are split tp ways. Must divide every head count and the vocabulary. With ep > 1 the
    tp ranks of a replica route different slices of its rows in MoE layers (`parallel.expert_parallel`)."""
    ep: int = 1
    """Expert-parallel degree: routed experts split ep ways over ranks that route different rows, taken from the
    dp_shard x tp ranks (torchtitan's efsdp x ep); must divide dp_shard * tp and the number of experts."""
    pp: int = 1
    """Pipeline-parallel degree: the decoder layers split into stages over pp ranks (`parallel.pipeline`; needs
    torch >= 2.14, see `pipeline_support`; not combined with tp > 1 or ep > 1)."""
    pp_schedule: Literal["1F1B", "Interleaved1F1B"] = "1F1B"
    """torch.distributed.pipelining schedule for pp > 1: "1F1B" runs one stage per rank and needs at least pp
    microbatches per replica; "Interleaved1F1B" runs two stages per rank (stage s on pp rank s mod pp), any count."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """What backward recomputes instead of keeping from the forward (`models.recompute`; flat, tree and carry
    execution alike, from the same layout). "none": keep every activation (most memory, no extra compute). "full":
    every decoder layer from its input (HARTS runs this way): least memory (one `[T, D]` input per layer), one more
    forward of every layer. "selective": what `selective` chooses (layer kinds, the part of a layer, every N-th layer,
    op outputs kept), in between on both counts."""
    selective: SelectiveRecompute = field(default_factory=SelectiveRecompute)
    """With activation_checkpointing = "selective" (TOML `[parallel.selective]`): `layers` (layer kinds that
    recompute), `part` ("layer", "mixer", "ffn"), `every` (N-th layer of those kinds), `save` (op groups kept:
    "attention" by default, "experts", "mm"); see `models.recompute.SelectiveRecompute` for each option's
    memory/compute trade. Refused with ep > 1 or pp > 1 (untested there)."""
    compile: bool = False
    """torch.compile the row-wise modules that hold no collectives (RMSNorms, SwiGLU MLPs outside tensor
    parallelism) with dynamic shapes. Whole layers are not compiled: their control flow follows each microbatch's
    plan (rounds, branches), so a compiled layer would recompile per microbatch."""
    compile_backend: str = "inductor"
    """torch.compile backend ("inductor"; "aot_eager" for a quick check without code generation)."""
    param_dtype: Literal["model", "float32", "bfloat16"] = "model"
    """FSDP2 compute dtype of parameters (cast when gathered for each forward; master weights and optimizer states
    keep the model dtype). "model" = no cast. GPU runs: fp32 model + "bfloat16"."""
    reduce_dtype: Literal["model", "float32", "bfloat16"] = "model"
    """FSDP2 dtype of gradient reduce-scatter / all-reduce; "model" = the model dtype."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered layer parameters after forward ("default" = yes without pipeline parallelism, no with it: each
    microbatch would gather them again, torchtitan's policy)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "ep", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"`parallel.{name}` must be >= 1, got {getattr(self, name)}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"`parallel.dp_shard` must be >= 1 or -1 (rest of the world), got {self.dp_shard}")
        if self.activation_checkpointing not in _CHECKPOINTING:
            raise ValueError(f"`parallel.activation_checkpointing` must be one of {_CHECKPOINTING}, got "
                             f"{self.activation_checkpointing!r}")
        if self.activation_checkpointing != "selective" and self.selective != SelectiveRecompute():
            raise ValueError(
                f"`parallel.selective` is set but `parallel.activation_checkpointing` is "
                f"{self.activation_checkpointing!r}, which ignores it: set activation_checkpointing = 'selective' or "
                "remove the [parallel.selective] settings"
            )
        if self.activation_checkpointing == "selective" and (self.ep > 1 or self.pp > 1):
            raise ValueError(
                f"`parallel.activation_checkpointing` = 'selective' with `parallel.ep` = {self.ep} / `parallel.pp` = "
                f"{self.pp}: untested (expert-parallel experts are their own FSDP2 unit inside the recomputed part, "
                "and torch's selective checkpoint refuses a recomputation that calls a saved op more often than the "
                "forward); use activation_checkpointing = 'full' with ep > 1 or pp > 1"
            )
        if self.pp_schedule not in _PP_SCHEDULES:
            raise ValueError(f"`parallel.pp_schedule` must be one of {_PP_SCHEDULES}, got {self.pp_schedule!r}")

    def resolved(self, world_size: int) -> "ParallelConfig":
        """A copy with dp_shard filled in for `world_size` ranks; raises if the degrees do not multiply to it."""
        fixed = self.pp * self.dp_replicate * self.tp
        dp_shard = world_size // fixed if self.dp_shard == -1 else self.dp_shard
        if dp_shard < 1 or fixed * dp_shard != world_size:
            raise ValueError(
                f"pp ({self.pp}) * dp_replicate ({self.dp_replicate}) * dp_shard ({self.dp_shard}) * tp ({self.tp}) "
                f"must equal the world size {world_size}: change the degrees or the number of launched ranks"
            )
        return ParallelConfig(**{**self.__dict__, "dp_shard": dp_shard})

    def reshard_after(self, pp_enabled: bool) -> bool:
        """The `reshard_after_forward` argument of FSDP2's `fully_shard` under this config's policy of that name
        (torchtitan's `get_fsdp_reshard_after_forward_policy`, restated here: its module imports
        `DataParallelMeshDims` from torch.distributed.fsdp, which torch 2.11, the torch of vLLM 0.26, lacks)."""
        return {"always": True, "never": False, "default": not pp_enabled}[self.reshard_after_forward]

    def recompute(self) -> bool | SelectiveRecompute:
        """What `HybridForCausalLM.set_activation_checkpointing` takes for `activation_checkpointing`."""
        if self.activation_checkpointing == "selective":
            return self.selective
        return self.activation_checkpointing == "full"

    def check_recompute(self, model: ModelConfig) -> None:
        """Raises ValueError when `selective` chooses no layer of `model` (`every` beyond its count of the kinds in
        `layers`)."""
        if self.activation_checkpointing == "selective":
            self.selective.per_layer(model)

    @property
    def dp(self) -> int:
        """D: data-parallel replicas, i.e. ranks that hold different microbatches (after `resolved`)."""
        return self.dp_replicate * self.dp_shard

    def validate(self, model: ModelConfig, *, pipelined: bool = False) -> None:
        """Check the (resolved) degrees against a model; raises ValueError / NotImplementedError naming the fix.
        `pipelined`: the caller splits the model into pipeline stages (`parallel.pipeline.pipeline_hybrid`)."""
        if self.dp_shard < 1:
            raise ValueError("call `ParallelConfig.resolved(world_size)` before `validate`: dp_shard is still -1")
        self.check_recompute(model)
        if self.pp > 1:
            self._validate_pipeline(model, pipelined)
        if self.ep > 1:
            if model.moe is None:
                raise ValueError(f"`parallel.ep` = {self.ep} but the model has no MoE layers: set ep = 1")
            if self.dp_shard * self.tp % self.ep:
                raise ValueError(
                    f"`parallel.ep` ({self.ep}) must divide `parallel.dp_shard` ({self.dp_shard}) * `parallel.tp` "
                    f"({self.tp}): expert-parallel groups are formed from those ranks (dp_replicate and pp ranks are "
                    "not part of them); choose such an ep, or move ranks from dp_replicate to dp_shard"
                )
            if model.moe.num_experts % self.ep:
                raise ValueError(
                    f"`parallel.ep` ({self.ep}) must divide the number of experts ({model.moe.num_experts})"
                )
        if self.tp > 1:
            for name, count in _tp_split_sizes(model).items():
                if count % self.tp:
                    raise ValueError(f"`parallel.tp` ({self.tp}) must divide {name} ({count})")

    def _validate_pipeline(self, model: ModelConfig, pipelined: bool) -> None:
        reason = pipeline_support()
        if reason is not None:
            raise NotImplementedError(f"`parallel.pp` = {self.pp}: {reason}; set pp = 1")
        if not pipelined:
            raise NotImplementedError(
                f"`parallel.pp` = {self.pp}: parallelize_hybrid does not split the model into pipeline stages; build "
                "it with parallel.pipeline.pipeline_hybrid (pipeline_for_job) and run parallel.pipeline."
                "pipeline_train_step, or set pp = 1"
            )
        if self.tp > 1 or self.ep > 1:
            raise NotImplementedError(
                f"`parallel.pp` = {self.pp} with `parallel.tp` = {self.tp} / `parallel.ep` = {self.ep}: pipeline "
                "stages are not combined with tensor or expert parallelism (the last stage would need the "
                "vocabulary-parallel log-probs, untested); use tp = ep = 1 with pp > 1, or pp = 1"
            )
        if model.tie_word_embeddings:
            raise NotImplementedError(
                f"`parallel.pp` = {self.pp} with `tie_word_embeddings`: the embedding lives on the first stage and "
                "the LM head on the last; untie the embeddings or set pp = 1"
            )
        stages = self.pp * (2 if self.pp_schedule == "Interleaved1F1B" else 1)
        if stages > model.num_layers + 2:
            raise ValueError(
                f"`parallel.pp` = {self.pp} with `parallel.pp_schedule` = {self.pp_schedule!r} makes {stages} stages "
                f"but the model has {model.num_layers} layers plus embedding and head: lower pp or use '1F1B'"
            )


_PP_SCHEDULES = ("1F1B", "Interleaved1F1B")
_CHECKPOINTING = ("none", "full", "selective")


def _tp_split_sizes(model: ModelConfig) -> dict[str, int]:
    """Every size tensor parallelism splits, by the config field that holds it."""
    sizes = {"vocab_size": model.vocab_size}
    full, linear = model.full_attention, model.linear_attention
    if isinstance(full, GatedAttentionConfig):
        sizes["full_attention.num_heads"] = full.num_heads
        sizes["full_attention.num_kv_heads"] = full.num_kv_heads
    elif isinstance(full, MLAConfig):
        sizes["full_attention.num_heads"] = full.num_heads
    if isinstance(linear, GDNConfig):
        sizes["linear_attention.num_k_heads"] = linear.num_k_heads
    elif isinstance(linear, KDAConfig):
        sizes["linear_attention.num_heads"] = linear.num_heads
    if model.dense_ffn is not None:
        sizes["dense_ffn.intermediate_size"] = model.dense_ffn.intermediate_size
    if model.moe is not None and model.moe.shared_expert_intermediate_size:
        sizes["moe.shared_expert_intermediate_size"] = model.moe.shared_expert_intermediate_size
    return sizes
