"""Plain-torch reference of `models.ops.kda.chains` (same signatures): a round's recurrences sequence by sequence,
the state carried from piece to piece (call by call it goes through the table entry the piece before wrote: the
same fp32 values).

Legend: T the layer's calls' rows, NT their chunks, M state-table entries, N_r sequences of the round, H query/key
heads, HV value heads, K/V head dims.

The kernels' arithmetic in torch: fp32 states, the operands of each product cast as the kernels cast them (the
state to the input dtype), new values and chunk states stored in the buffers' dtypes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.ops.kda.call_arrays import ChainArrays

__all__ = ["naive_fwd_h_chains", "naive_bwd_dhu_chains"]


def _pieces(chains: ChainArrays):
    """(sequence, bos, eos, boh, entry) of every piece, sequence by sequence in call order."""
    cols = (chains.piece_bos, chains.piece_eos, chains.piece_boh, chains.piece_state)
    bounds = chains.pieces.tolist()
    for n in range(chains.num_sequences):
        for p in range(bounds[n], bounds[n + 1]):
            yield n, *(int(c[p]) for c in cols)


def _heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """`[1, T, H, D]` -> `[T, HV, D]`: value head j reads query/key head j // (HV // H)."""
    return x[0].repeat_interleave(HV // x.shape[2], dim=1)


def naive_fwd_h_chains(h, v_new, k, w, u, gk, table, chains: ChainArrays, chunk_size: int, store_states: bool,
                       config: dict | None = None) -> None:
    """`models.ops.kda.chains.fwd_h_chains`: h `[1, NT, HV, K, V]`, v_new `[1, T, HV, V]` written, table
    `[M, HV, K, V]` fp32 read (and written with `store_states`); k `[1, T, H, K]`, w, gk `[1, T, HV, K]`, u
    `[1, T, HV, V]`; `config` (the kernels' launch config) is not read."""
    kh = _heads(k, u.shape[2])
    init = chains.init.tolist()
    state, current = None, None
    for n, bos, eos, boh, entry in _pieces(chains):
        if current != n:
            state, current = table[init[n]].float().clone(), n
        for c, start in enumerate(range(bos, eos, chunk_size)):
            end = min(start + chunk_size, eos)
            h[0, boh + c] = state.to(h.dtype)
            new = u[0, start:end].float() - torch.einsum("thk,hkv->thv", w[0, start:end], state.to(w.dtype)).float()
            v_new[0, start:end] = new.to(v_new.dtype)
            state = state * torch.exp2(gk[0, end - 1].float())[..., None]
            state = state + torch.einsum("thk,thv->hkv", kh[start:end], new.to(k.dtype)).float()
        if store_states:
            table[entry] = state


def naive_bwd_dhu_chains(dh, dv2, q, k, w, do, dv, gk, d_table, scale: float, chains: ChainArrays,
                         chunk_size: int, config: dict | None = None) -> torch.Tensor:
    """`models.ops.kda.chains.bwd_dhu_chains`: dh `[1, NT, HV, K, V]`, dv2 `[1, T, HV, V]` written, d_table
    `[M, HV, K, V]` fp32 read; returns the initial-state gradients `[N_r, HV, K, V]` fp32 (`config` not read)."""
    HV = do.shape[2]
    qh, kh = _heads(q, HV), _heads(k, HV)
    dh0 = d_table.new_zeros(chains.num_sequences, *d_table.shape[1:])
    pieces = list(_pieces(chains))
    grad, current = None, None
    for n, bos, eos, boh, entry in reversed(pieces):
        grad = d_table[entry].float().clone() + (grad if current == n else 0)
        current = n
        starts = list(range(bos, eos, chunk_size))
        for c in reversed(range(len(starts))):
            start, end = starts[c], min(starts[c] + chunk_size, eos)
            dh[0, boh + c] = grad.to(dh.dtype)
            d_new = torch.einsum("thk,hkv->thv", kh[start:end], grad.to(k.dtype)).float() + dv[0, start:end].float()
            dv2[0, start:end] = d_new.to(dv2.dtype)
            grad = grad * torch.exp2(gk[0, end - 1].float())[..., None]
            grad = grad + torch.einsum("thk,thv->hkv", qh[start:end], do[0, start:end].to(q.dtype)).float() * scale
            grad = grad - torch.einsum("thk,thv->hkv", w[0, start:end], d_new.to(w.dtype)).float()
        dh0[n] = grad
    return dh0
