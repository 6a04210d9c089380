"""parallel.tree_module: the outputs FSDP2 hooks expose their tensors to pytree traversal, and the vocabulary-parallel
log-probs refuse a model whose embeddings are not sharded; parallel.vocab_parallel (the log-probs of
`VocabParallelCausalLM`) on gloo ranks equals `models.logprobs.compact_logprobs` on the whole LM head.

Tolerance: float64; sharded and whole agree to 1e-10 relative (the arithmetic differs only in summation order)."""

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from models.decoder import HybridForCausalLM
from models.logprobs import compact_logprobs
from models.tree.layout import TreeLayout
from models.tree.mixers import TreeContext
from parallel.collectives import copy_to_group
from parallel.tree_module import use_vocab_parallel_logprobs
from parallel.vocab_parallel import vocab_parallel_compact_logprobs
from planner.calls.plan import plan_calls
from planner.pack import pack
from tests.parallel.harness import run_ranks, small_config, step_trajectories

TOL = 1e-10


def test_tree_output_tensors_are_pytree_leaves():
    config = small_config("tiny-qwen3-next")
    model = HybridForCausalLM(config)
    batch = pack(step_trajectories(config, trees=1)[:3])
    out = model(TreeContext(TreeLayout.build(batch, plan_calls(batch, 16), 4)))
    leaves = pytree.tree_leaves(out)
    moe = [s for s in out.moe_stats if s is not None]
    assert any(t is out.logprobs for t in leaves) and any(t is out.hidden for t in leaves)
    assert moe and all(any(t is s.z_sum for t in leaves) for s in moe)


def test_vocab_parallel_logprobs_need_sharded_embeddings():
    model = HybridForCausalLM(small_config("tiny-qwen3-next"))
    with pytest.raises(ValueError, match="apply_tensor_parallel"):
        use_vocab_parallel_logprobs(model)


def rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-300)


def _logprobs_and_grads(fn, hidden, weight, rows, target, coef, entropy, **kwargs):
    """Log-probs, entropies and the gradients of a fixed linear loss in both; `fn` takes the leaves' values."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(hidden, weight, rows, target, entropy=entropy, **kwargs)
    lp, ent = out if entropy else (out, torch.zeros_like(out))
    loss = (coef[0] * lp).sum() + (coef[1] * ent).sum()
    return lp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight))


def _vocab_parallel_matches_whole_head():
    dist.init_process_group("gloo")
    rank, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    C, D, Vl, S = 13, 7, 15, 40
    hidden = torch.randn(C, D, dtype=torch.float64, generator=g)
    # Scaled so that some rows are peaked (large logits, low entropy) and some flat.
    weight = 3 * torch.randn(t * Vl, D, dtype=torch.float64, generator=g)
    rows = torch.randint(-1, C, (S,), generator=g)
    target = torch.randint(0, t * Vl, (S,), generator=g)
    rows[:6] = 4  # one row read by several positions whose targets lie on every shard
    target[:6] = torch.arange(6) * (t * Vl - 1) // 5
    coef = torch.randn(2, S, dtype=torch.float64, generator=g)
    mine = slice(rank * Vl, (rank + 1) * Vl)

    def sharded(h, w, *args, **kwargs):
        return vocab_parallel_compact_logprobs(copy_to_group(h, dist.group.WORLD), w, *args, **kwargs)

    for entropy in (False, True):
        want = _logprobs_and_grads(compact_logprobs, hidden, weight, rows, target, coef, entropy)
        got = _logprobs_and_grads(sharded, hidden, weight[mine], rows, target, coef, entropy,
                                  vocab_start=rank * Vl, group=dist.group.WORLD, chunk_rows=3)
        names = ("logprobs", "entropy", "d hidden", "d weight")
        for name, a, b in zip(names, got, (*want[:3], want[3][mine])):
            assert rel(a, b) < TOL, f"rank {rank} entropy={entropy}: {name} off by {rel(a, b):.2e}"
        assert (got[0][rows < 0] == 0).all()
    with pytest.raises(ValueError, match=f"0, {t * Vl}"):
        sharded(hidden, weight[mine], rows, torch.full_like(target, t * Vl), vocab_start=rank * Vl,
                group=dist.group.WORLD)


def test_vocab_parallel_logprobs_match_whole_head():
    run_ranks(2, _vocab_parallel_matches_whole_head)
