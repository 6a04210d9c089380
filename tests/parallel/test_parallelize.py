"""apply_compile (the compile stage of parallelize_hybrid): compiled RMSNorms and SwiGLUs give the eager tree
execution's log-probs and gradients on microbatches of different sizes (dynamic shapes, float64)."""

import copy

import torch

from models.decoder import HybridForCausalLM
from models.ffn import SwiGLU
from models.norms import RMSNorm
from models.tree.layout import TreeLayout
from models.tree.mixers import TreeContext
from parallel.parallelize import apply_compile
from planner.calls.plan import plan_calls
from planner.pack import pack
from tests.parallel.harness import small_config, step_trajectories


def test_compiled_rowwise_modules_match_eager():
    config = small_config("tiny-qwen3-next")
    torch.manual_seed(0)
    eager = HybridForCausalLM(config)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="aot_eager")
    assert all(m._compiled_call_impl is not None for m in compiled.modules() if isinstance(m, (RMSNorm, SwiGLU)))
    trajectories = step_trajectories(config, trees=2)
    for part in (trajectories[:7], trajectories[7:]):
        batch = pack(part)
        layout = TreeLayout.build(batch, plan_calls(batch, 16), 4)
        outputs = []
        for model in (eager, compiled):
            lp = model(TreeContext(layout)).logprobs
            (lp * torch.as_tensor(batch.advantage)).sum().backward()
            outputs.append(lp)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-14, msg=name)
