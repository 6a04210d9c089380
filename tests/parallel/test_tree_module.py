"""parallel.tree_module: the outputs FSDP2 hooks expose their tensors to pytree traversal, and the vocabulary-parallel
log-probs refuse a model whose embeddings are not sharded."""

import pytest
import torch.utils._pytree as pytree

from models.decoder import HybridForCausalLM
from models.tree.layout import TreeLayout
from parallel.tree_module import use_vocab_parallel_logprobs
from planner.calls import plan_calls
from planner.pack import pack
from tests.parallel.harness import small_config, step_trajectories


def test_tree_output_tensors_are_pytree_leaves():
    config = small_config("tiny-qwen3-next")
    model = HybridForCausalLM(config)
    batch = pack(step_trajectories(config, trees=1)[:3])
    out = model(TreeLayout.build(batch, plan_calls(batch, 16), 4))
    leaves = pytree.tree_leaves(out)
    moe = [s for s in out.moe_stats if s is not None]
    assert any(t is out.logprobs for t in leaves) and any(t is out.hidden for t in leaves)
    assert moe and all(any(t is s.z_sum for t in leaves) for s in moe)


def test_vocab_parallel_logprobs_need_sharded_embeddings():
    model = HybridForCausalLM(small_config("tiny-qwen3-next"))
    with pytest.raises(ValueError, match="apply_tensor_parallel"):
        use_vocab_parallel_logprobs(model)
