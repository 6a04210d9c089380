"""`parallelize_hybrid`: tensor/expert parallelism -> activation checkpointing -> compile -> FSDP2, in one place.

Why this order (torchtitan's `parallelize_qwen3` uses the same):
- TP/EP first: they replace parameters by DTensors on the tp/ep meshes and swap module classes (under TP also the
  model's, for vocabulary-parallel log-probs: `parallel.tree_module`); FSDP2 must see those DTensors to shard them
  again over the data-parallel mesh (2-D parameters), and checkpointing and compile must wrap the code that finally
  runs (with its collectives). Under tp x ep, TP shards everything but the MoE layers and EP takes those whole
  (rows split over tp, routed experts over ep, shared expert over tp: `parallel.expert_parallel`).
- Activation checkpointing next: recomputation runs inside each FSDP unit (`DecoderLayer.forward`), after FSDP2
  has gathered the unit's parameters for backward.
- Compile after checkpointing and before FSDP2, so compiled regions hold model math only and FSDP2's hooks stay
  outside them.
- FSDP2 last: it wraps the finished modules, and its units (layers, experts, root) are the modules tree execution
  calls (`model(ctx, ...)`, then each layer from the model's layer loop).
"""

from __future__ import annotations

from models.decoder import HybridForCausalLM
from models.ffn import SwiGLU
from models.norms import RMSNorm
from parallel.config import ParallelConfig
from parallel.expert_parallel import apply_expert_parallel
from parallel.fsdp import apply_fsdp
from parallel.local_params import LocalParams
from parallel.mesh import ParallelMeshes
from parallel.tensor_parallel import apply_tensor_parallel
from parallel.tree_module import use_vocab_parallel_logprobs

__all__ = ["parallelize_hybrid"]


def apply_compile(model: HybridForCausalLM, backend: str) -> None:
    """torch.compile (dynamic shapes) every RMSNorm and every SwiGLU that is not tensor-parallel."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SwiGLU)) and not isinstance(module, LocalParams):
            module.compile(backend=backend, dynamic=True)


def parallelize_hybrid(model: HybridForCausalLM, meshes: ParallelMeshes, config: ParallelConfig) -> HybridForCausalLM:
    """Wrap `model` in place for `meshes` (built from the same resolved `config`) and return it.

    After this, run steps with `parallel.plain_runner.PlainRunner` (or call `model(TreeContext(layout), ...)`);
    the parameters are DTensors (save them with `parallel.checkpoint`).
    """
    config.validate(model.config)
    if config.tp > 1:
        apply_tensor_parallel(model, meshes.tp, moe_layers=config.ep == 1)
        use_vocab_parallel_logprobs(model)
    if config.ep > 1:
        apply_expert_parallel(model, meshes.ep, meshes.tp if config.tp > 1 else None)
    model.set_activation_checkpointing(config.recompute())
    if config.compile:
        apply_compile(model, config.compile_backend)
    apply_fsdp([model], meshes, config)
    return model
