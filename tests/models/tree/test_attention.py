"""Tree attention backends vs per-trajectory causal attention (float64: 1e-12; the dense mask must bite)."""

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.tree.attention import tree_attention
from models.tree.device_copy import to_device
from models.tree.layout import build_attention_layout
from planner.index_arrays import inverse_permutation
from planner.pack import pack
from tests.planner.trees import rollout_batches

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def segment_order_layout(batch, seed, max_view_rows=None):
    """Physical order = segments in a random order (each segment is a path, so a valid branch)."""
    rng = np.random.default_rng(seed)
    segs = rng.permutation(batch.num_segments)
    phys = np.concatenate([np.arange(batch.seg_offsets[g], batch.seg_offsets[g + 1]) for g in segs])
    lengths = np.diff(batch.seg_offsets)[segs]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    return phys, build_attention_layout(batch, phys, inverse_permutation(phys), cu, max_view_rows=max_view_rows)


def random_qkv(C: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """float64 q, k, v `[C, 2, 4]` that require grad, and an output weight `[C, 2, 4]`."""
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(C, 2, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3)]
    return qkv, torch.randn(C, 2, 4, dtype=torch.float64, generator=g)


def flat_attention(q, k, v, scale):
    L, H = q.shape[:2]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    s = torch.einsum("qhk,shk->hqs", q, k) * scale
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqs,shv->qhv", torch.softmax(s, -1), v)


@settings(max_examples=30, deadline=None)
@given(rollout_batches(), st.sampled_from(["dense", "flex", "branch"]), st.integers(0, 100))
def test_tree_attention_equals_trajectory_attention(trajectories, backend, seed):
    batch = pack(trajectories)
    phys, layout = segment_order_layout(batch, seed, max_view_rows=[None, 1, 9][seed % 3])
    g = torch.Generator().manual_seed(seed)
    C, H, G, K, V = batch.num_compact, 4, 2, 8, 6
    q_c = torch.randn(C, H, K, dtype=torch.float64, generator=g)  # per compact row (row-wise projections)
    k_c = torch.randn(C, G, K, dtype=torch.float64, generator=g)
    v_c = torch.randn(C, G, V, dtype=torch.float64, generator=g)
    out = tree_attention(q_c[phys], k_c[phys], v_c[phys], layout, 0.3, backend)
    compact_to_phys = np.argsort(phys)
    for i in range(len(trajectories)):
        rows = batch.sem_to_compact[batch.traj_offsets[i] : batch.traj_offsets[i + 1]]
        ref = flat_attention(q_c[rows], k_c[rows], v_c[rows], 0.3)
        assert (out[compact_to_phys[rows]] - ref).abs().max().item() < 1e-12


def test_gradients_accumulate_into_shared_rows():
    from planner.trajectory import Trajectory

    batch = pack([Trajectory([1, 2, 3, 4]), Trajectory([1, 2, 5, 6, 7]), Trajectory([1, 8])])
    phys, layout = segment_order_layout(batch, 0)
    qkv, w = random_qkv(batch.num_compact)
    grads = {}
    # FlexAttention has no CPU backward (torch 2.13); its gradients are checked on CUDA by bench.fidelity.
    for backend in ("dense", "branch"):
        out = tree_attention(*(x[phys] for x in qkv), layout, 0.5, backend)
        grads[backend] = torch.autograd.grad((out * w[phys]).sum(), qkv)
    for a, b in zip(grads["branch"], grads["dense"]):
        assert (a - b).abs().max() < 1e-12
    assert grads["dense"][1][0].abs().sum() > 0  # the root key is read by every descendant


@settings(max_examples=25, deadline=None)
@given(rollout_batches(), st.sampled_from([None, 1, 6, 20]), st.integers(0, 100), st.booleans())
def test_branch_groups_gradients_equal_dense(trajectories, max_view_rows, seed, pad_once):
    """Grouped branch views (regathered in backward, dk/dv scatter-added over groups) vs the dense mask, with GQA and
    a value head dim below the key head dim: unpadded (the reference kernels), and padded once to the key
    head dim before the views are gathered, as for flash's kernels (`pads_values`), with out and dv cut back."""
    batch = pack(trajectories)
    phys, layout = segment_order_layout(batch, seed, max_view_rows)
    views = [layout.kv_index[g.kv].numel() for g in layout.groups]
    assert sum(views) == layout.kv_index.numel() and layout.groups[-1].rows.stop == batch.num_compact
    assert all(v <= (max_view_rows or batch.num_compact) or len(g.cu_q) == 2 for v, g in zip(views, layout.groups))
    g = torch.Generator().manual_seed(seed)
    C, H, G, K, V = batch.num_compact, 4, 2, 8, 6
    qkv = [torch.randn(C, h, d, dtype=torch.float64, generator=g, requires_grad=True)
           for h, d in ((H, K), (G, K), (G, V))]
    w = torch.randn(C, H, V, dtype=torch.float64, generator=g)
    grads = {}
    with mock.patch("models.tree.branch_attention.pads_values", lambda q, v, pair: pad_once):
        for backend in ("dense", "branch"):
            out = tree_attention(*qkv, layout, 0.4, backend)
            grads[backend] = (out.detach(), *torch.autograd.grad((out * w).sum(), qkv))
    for a, b in zip(grads["branch"], grads["dense"]):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("share", [False, True])
def test_groups_without_ancestors_read_their_rows_in_place(share):
    """Groups whose branches have no ancestors (every group of a flat expansion; the first trunks of a shared trie)
    read k and v in place and add their gradients without a scatter: equal to the dense mask (float64, 1e-12), and
    no view is gathered for them (profiled regions)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.ceiling import tree_regions
    from planner.trajectory import Trajectory

    rng = np.random.default_rng(1)
    trunk = rng.integers(0, 9, 20)
    trajectories = [Trajectory(rng.integers(0, 9, 13)), Trajectory(rng.integers(0, 9, 7)),
                    *(Trajectory(np.concatenate([trunk[:cut], rng.integers(0, 9, 6)])) for cut in (20, 12, 5))]
    batch = pack(trajectories, share=share)
    _, layout = segment_order_layout(batch, 0, max_view_rows=24)
    own = [g.own_rows for g in layout.groups]
    assert all(own) if not share else (any(own) and not all(own))
    qkv, w = random_qkv(batch.num_compact)
    res = {}
    for backend in ("dense", "branch"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = tree_attention(*qkv, layout, 0.5, backend)
            res[backend] = (out.detach(), *torch.autograd.grad((out * w).sum(), qkv))
    for a, b in zip(res["branch"], res["dense"]):
        assert (a - b).abs().max() < 1e-12
    gathers = {name: n for name, _, n in tree_regions(prof) if name.startswith("branch view")}
    gathered = 2 * sum(not o for o in own)  # forward and backward
    assert gathers.get("branch view gather", 0) == gathered
    assert gathers.get("branch view scatter-add", 0) == gathered // 2


def test_unknown_backend():
    from planner.trajectory import Trajectory

    batch = pack([Trajectory([1, 2])])
    _, layout = segment_order_layout(batch, 0)
    x = torch.zeros(2, 1, 2)
    with pytest.raises(ValueError, match="backend"):
        tree_attention(x, x, x, layout, 1.0, "magic")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA branch path needs CUDA")
@pytest.mark.parametrize("K,V", [(64, 32), (192, 128)])
def test_branch_groups_on_cuda(K, V, cuda_attention_pair):
    """bf16 grouped branch views on each CUDA kernel pair vs the dense reference (fp32 math), value head dim below
    q/k's: padded once before the gather (64/32), or run at its own dim by fa4 (ling-3-tiny's 192/128)."""
    from planner.trajectory import Trajectory

    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 50, 300)
    trajectories = [Trajectory(np.concatenate([prefix[:cut], rng.integers(0, 50, 200)])) for cut in (300, 300, 120, 7)]
    batch = pack(trajectories)
    phys, layout = segment_order_layout(batch, 0, max_view_rows=400)
    layout = to_device(layout, "cuda")
    assert len(layout.groups) > 1
    g = torch.Generator(device="cuda").manual_seed(0)
    C = batch.num_compact
    qkv = [torch.randn(C, 4, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
           for d in (K, K, V)]
    w = torch.randn(C, 4, V, device="cuda", dtype=torch.bfloat16, generator=g)
    res = {}
    for backend in ("dense", "branch"):
        out = tree_attention(*qkv, layout, K**-0.5, backend, cuda_attention_pair)
        res[backend] = (out.detach(), *torch.autograd.grad((out.float() * w.float()).sum(), qkv))
    for name, a, b in zip(("out", "dq", "dk", "dv"), res["branch"], res["dense"]):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 2e-2, f"{name}: relative error {err:.2e}"
