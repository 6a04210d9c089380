"""Inputs and independent ground truths for the delta-rule op tests.

Legend: B batch rows, T tokens, N sequences, H query/key heads, HV value heads, K/V head dims.
"""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F


def make_inputs(B, T, H, HV, K, V, per_channel_gate, dtype, N=None, seed=0, requires_grad=False):
    """Random q, k (unit norm), v, g (log decay in [-0.3, 0]), beta in (0, 1), initial state `[N, HV, K, V]`."""
    gen = torch.Generator().manual_seed(seed)
    N = B if N is None else N

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = dict(
        q=randn(B, T, H, K),
        k=F.normalize(randn(B, T, H, K), dim=-1),
        v=randn(B, T, HV, V),
        g=-0.3 * rand(*((B, T, HV, K) if per_channel_gate else (B, T, HV))),
        beta=rand(B, T, HV),
        initial_state=randn(N, HV, K, V),
    )
    return {name: t.to(dtype).requires_grad_(requires_grad) for name, t in tensors.items()}


def sequential_delta_rule(q, k, v, g, beta, scale, initial_state):
    """Token-by-token gated delta rule of one batch of sequences (ground truth, written independently of the ops).

    q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g `[B, T, HV, K]` or `[B, T, HV]`, beta `[B, T, HV]`, initial_state
    `[B, HV, K, V]`. Returns (o `[B, T, HV, V]`, final state `[B, HV, K, V]`) in the input dtype.
    """
    B, T, H, K = q.shape
    group = v.shape[2] // H
    if g.dim() == 3:
        g = g[..., None].expand(*g.shape, K)
    state = initial_state
    outputs = []
    for t in range(T):
        q_t = q[:, t].repeat_interleave(group, dim=1) * scale  # [B, HV, K]
        k_t = k[:, t].repeat_interleave(group, dim=1)
        state = state * g[:, t].exp()[..., None]
        prediction = torch.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, t, :, None] * (v[:, t] - prediction))
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, state))
    return torch.stack(outputs, dim=1), state


def load_fla_naive(relative_path):
    """Load one of fla's pure-torch `naive.py` files by path: importing `fla.ops` itself takes ~13 s on CPU."""
    root = Path(importlib.util.find_spec("fla").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location(f"fla_naive_{relative_path.replace('/', '_')}", root / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pack(tensors, lengths):
    """Sequences `[1, T_i, ...]` concatenated along T, plus cu_seqlens `[N+1]`."""
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.cat(tensors, dim=1), cu_seqlens
