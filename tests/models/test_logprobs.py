"""Compact-to-semantic log-probabilities, and a small transformer run on the trie equals trajectory-wise training.

Tolerances: float64 everywhere; tree vs flat and chunked vs naive agree to 1e-10 relative (the arithmetic differs
only in summation order).
"""

import math

import pytest
import torch
from hypothesis import given, settings

from models import logprobs
from models.logprobs import (
    VocabShards,
    compact_logprobs,
    naive_compact_logprobs,
    sharded_compact_logprobs,
    whole_chunks,
)
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.trees import rollout_batches

TOL = 1e-10


def rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-300)


@pytest.mark.parametrize("group_chunks", [1, 2, None], ids=["group1", "group2", "one-group"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
@pytest.mark.parametrize("entropy", [False, True])
def test_compact_logprobs_matches_naive(chunk_rows, entropy, group_chunks, monkeypatch):
    """Also with the LM-head gradient accumulated per chunk, per two chunks (the last group short) and once."""
    if group_chunks is not None:
        monkeypatch.setattr(logprobs, "WEIGHT_GRAD_GROUP_BYTES", group_chunks * min(chunk_rows, 13) * 29 * 8)
    g = torch.Generator().manual_seed(0)
    C, D, V, S = 13, 7, 29, 40
    hidden = torch.randn(C, D, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.randint(-1, C, (S,), generator=g)
    rows[:5] = 4  # one row read by several positions with different targets
    target = torch.randint(0, V, (S,), generator=g)
    coef = torch.randn(S, dtype=torch.float64, generator=g)
    results = []
    for fn in (compact_logprobs, naive_compact_logprobs):
        out = fn(hidden, weight, rows, target, chunk_rows=chunk_rows, entropy=entropy)
        lp, ent = out if entropy else (out, torch.zeros(()))
        loss = (coef * lp).sum() + (0.3 * coef * ent).sum() if entropy else (coef * lp).sum()
        dh, dw = torch.autograd.grad(loss, (hidden, weight))
        results.append((lp.detach(), ent.detach(), dh, dw))
    for a, b in zip(*results):
        assert rel(a, b) < TOL
    assert (results[0][0][rows < 0] == 0).all()


@pytest.mark.parametrize("chunk_rows", [3, 5, 1000])
def test_full_chunks_change_nothing_but_the_chunk_shapes(chunk_rows):
    """With every chunk padded to `chunk_rows` rows (the CUDA default, `whole_chunks`), log-probs, entropies and both
    gradients equal the naive reference's: the copies of the last used row add nothing and get no gradient."""
    g = torch.Generator().manual_seed(2)
    C, D, V, S = 13, 7, 29, 40
    hidden = torch.randn(C, D, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.randint(-1, C, (S,), generator=g)
    target = torch.randint(0, V, (S,), generator=g)
    coef = torch.randn(S, dtype=torch.float64, generator=g)
    assert whole_chunks(torch.unique(rows[rows >= 0]), chunk_rows).numel() % chunk_rows == 0
    results = []
    for run in (
        lambda: sharded_compact_logprobs(hidden, weight, rows, target, VocabShards(), chunk_rows=chunk_rows,
                                         entropy=True, full_chunks=True),
        lambda: naive_compact_logprobs(hidden, weight, rows, target, entropy=True),
    ):
        lp, ent = run()
        dh, dw = torch.autograd.grad((coef * lp).sum() + (0.3 * coef * ent).sum(), (hidden, weight))
        results.append((lp.detach(), ent.detach(), dh, dw))
    for a, b in zip(*results):
        assert rel(a, b) < TOL


def test_whole_chunks_pads_with_the_last_row():
    assert whole_chunks(torch.tensor([2, 5, 7]), 4).tolist() == [2, 5, 7, 7]
    assert whole_chunks(torch.tensor([2, 5, 7, 9]), 2).tolist() == [2, 5, 7, 9]
    assert whole_chunks(torch.tensor([], dtype=torch.long), 4).numel() == 0


def test_compact_logprobs_gradcheck():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([-1, 0, 0, 2, 4, 4, 4])
    target = torch.tensor([0, 1, 2, 3, 5, 5, 0])
    torch.autograd.gradcheck(
        lambda h, w: compact_logprobs(h, w, rows, target, chunk_rows=2, entropy=True), (hidden, weight)
    )


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_bf16_logits_and_lm_head_grad_accumulate_in_fp32(device):
    """bf16 hidden states and LM head: logits are fp32 sums of the exact bf16 products (on CUDA one fp32-output GEMM
    per chunk), never rounded to bf16: against float64 on the same bf16 values logprobs agree to ~1e-6, where a bf16
    product (logit error ~1e-2) fails the 1e-4 bound. The LM-head gradient is accumulated over the 8 chunks into one
    fp32 buffer (on CUDA by the GEMM itself, beta = 1): it must equal float64's up to the final bf16 rounding (~2e-3);
    a GEMM that overwrote the accumulator would keep one chunk of eight."""
    g = torch.Generator().manual_seed(3)
    C, D, V, S = 64, 256, 1000, 96
    hidden = (torch.randn(C, D, generator=g) / 4).to(torch.bfloat16)
    weight = torch.randn(V, D, generator=g).to(torch.bfloat16)
    rows = torch.randint(0, C, (S,), generator=g)
    target = torch.randint(0, V, (S,), generator=g)
    coef = torch.randn(S, generator=g, dtype=torch.float64)
    results = []
    for dtype, dev in ((torch.float64, "cpu"), (torch.bfloat16, device)):
        h = hidden.to(dev, dtype).requires_grad_()
        w = weight.to(dev, dtype).requires_grad_()
        lp = compact_logprobs(h, w, rows.to(dev), target.to(dev), chunk_rows=8)
        (coef.to(dev, lp.dtype) * lp).sum().backward()
        results.append((lp.double().cpu(), w.grad.double().cpu()))
    (lp64, dw64), (lp16, dw16) = results
    assert (lp16 - lp64).abs().max().item() < 1e-4
    assert rel(dw16, dw64) < 3e-3


@pytest.mark.parametrize(
    "device, D, V",
    [("cpu", 256, 4096),
     pytest.param("cuda", 1536, 157_184, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_a_rows_bf16_logprob_does_not_depend_on_the_rows_sharing_its_chunk(device, D, V):
    """Tree and flat microbatches put a row into chunks of other sizes and other company (ling-3-tiny's LM head: 426
    rows per chunk), so bitwise tree-vs-flat log-probs need each row's log-prob to be the same bits whatever rows
    share its chunk: all 900 rows, the last 48 alone, and all rows shuffled (on the CPU chunks of 426, 426, 48 and
    one of 48; on CUDA every chunk is padded to 426 rows). The CUDA case has ling-3-tiny's LM-head shape; it guards
    against a 1.9e-6 tree-vs-flat log-prob difference with bitwise-equal hidden states (its GPU runs:
    bench/RESULTS.md, "GPU: CUDA tests")."""
    g = torch.Generator().manual_seed(4)
    C = 900
    hidden = torch.randn(C, D, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(device, torch.bfloat16)
    target = torch.randint(0, V, (C,), generator=g).to(device)
    rows = torch.arange(C, device=device)
    full = compact_logprobs(hidden, weight, rows, target, chunk_rows=426)
    tail = torch.arange(C - 48, C, device=device)
    alone = compact_logprobs(hidden[tail], weight, torch.arange(48, device=device), target[tail], chunk_rows=426)
    perm = torch.randperm(C, generator=g).to(device)
    shuffled = compact_logprobs(hidden[perm], weight, rows, target[perm], chunk_rows=426)
    for name, got, want in (("alone", alone, full[tail]), ("shuffled", shuffled, full[perm])):
        diff = (got - want).abs().max().item()
        assert torch.equal(got, want), f"{name}: max abs diff {diff:.3e}"


def test_bad_targets_are_errors():
    h, w = torch.zeros(3, 2), torch.zeros(5, 2)
    with pytest.raises(ValueError, match="vocabulary"):
        compact_logprobs(h, w, torch.tensor([0, 1]), torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="rows"):
        compact_logprobs(h, w, torch.tensor([0, 3]), torch.tensor([1, 2]))


class TinyTransformer(torch.nn.Module):
    """Pre-norm causal transformer with RoPE; attention takes an explicit boolean visibility mask [T, T]."""

    def __init__(self, vocab=7, dim=16, heads=2, layers=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(
                torch.nn.ModuleDict(
                    dict(
                        n1=torch.nn.LayerNorm(dim),
                        qkv=torch.nn.Linear(dim, 3 * dim),
                        o=torch.nn.Linear(dim, dim),
                        n2=torch.nn.LayerNorm(dim),
                        up=torch.nn.Linear(dim, 4 * dim),
                        down=torch.nn.Linear(4 * dim, dim),
                    )
                )
            )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.double()

    def rope(self, x, pos):
        half = x.shape[-1] // 2
        freq = 1.0 / (100.0 ** (torch.arange(half, dtype=x.dtype) / half))
        ang = pos[:, None, None].to(x.dtype) * freq
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)

    def forward(self, ids, pos, visible):
        x = self.embed(ids)
        T, Dm = x.shape
        for b in self.blocks:
            q, k, v = b["qkv"](b["n1"](x)).view(T, 3, self.heads, Dm // self.heads).unbind(1)
            q, k = self.rope(q, pos), self.rope(k, pos)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(Dm // self.heads)
            a = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
            x = x + b["o"](torch.einsum("hqk,khd->qhd", a, v).reshape(T, Dm))
            x = x + b["down"](torch.nn.functional.gelu(b["up"](b["n2"](x))))
        return self.norm(x)


def tree_visibility(batch):
    """visible[q, k] = row k is an ancestor-or-self of row q (preorder: k <= q < subtree_end[k])."""
    r = torch.arange(batch.num_compact)
    end = torch.as_tensor(batch.subtree_end)
    return (r[None, :] <= r[:, None]) & (r[:, None] < end[None, :])


def policy_loss(logprobs, batch):
    """A per-token objective with per-position metadata (advantage, mask, weight) and a global normaliser."""
    adv = torch.as_tensor(batch.advantage)
    mask = torch.as_tensor(batch.loss_mask, dtype=torch.float64)
    w = torch.as_tensor(batch.weight)
    return -(w * adv * mask * logprobs).sum() / mask.sum().clamp(min=1)


@settings(max_examples=25, deadline=None)
@given(rollout_batches(vocab=7))
def test_trie_transformer_equals_trajectory_wise(trajectories):
    model = TinyTransformer()
    batch = pack(trajectories)
    params = list(model.parameters())

    hidden = model(torch.as_tensor(batch.tokens), torch.as_tensor(batch.positions), tree_visibility(batch))
    lp_tree = compact_logprobs(
        hidden, model.head.weight, torch.as_tensor(batch.logit_row), torch.as_tensor(batch.sem_tokens), chunk_rows=3
    )
    loss_tree = policy_loss(lp_tree, batch)
    g_tree = torch.autograd.grad(loss_tree, params, allow_unused=True)

    parts = []
    for t in trajectories:
        ids = torch.as_tensor(t.tokens)
        L = ids.numel()
        h = model(ids, torch.arange(L), torch.ones(L, L, dtype=torch.bool).tril())
        logp = torch.log_softmax(model.head(h), -1)
        lp = torch.zeros(L, dtype=torch.float64)
        lp[1:] = logp[:-1].gather(1, ids[1:, None])[:, 0]
        parts.append(lp)
    lp_flat = torch.cat(parts)
    loss_flat = policy_loss(lp_flat, batch)
    g_flat = torch.autograd.grad(loss_flat, params, allow_unused=True)

    assert (lp_tree - lp_flat).abs().max().item() < TOL
    assert abs(loss_tree.item() - loss_flat.item()) < TOL * max(1.0, abs(loss_flat.item()))
    for p, a, b in zip(params, g_tree, g_flat):
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        assert (a - b).norm().item() <= TOL * max(b.norm().item(), 1e-12), p.shape


def test_trie_mask_bites():
    """A plain causal mask over the packed rows (siblings visible) must break equality: the test can fail."""
    A, B, C, D, E = 1, 2, 3, 4, 5
    batch = pack([Trajectory([A, B, C, D]), Trajectory([A, B, E, D])])
    model = TinyTransformer()
    ids, pos = torch.as_tensor(batch.tokens), torch.as_tensor(batch.positions)
    good = model(ids, pos, tree_visibility(batch))
    bad = model(ids, pos, torch.ones(batch.num_compact, batch.num_compact, dtype=torch.bool).tril())
    assert (good - bad).abs().max() > 1e-3
