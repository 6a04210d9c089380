"""Plain-torch reference of the packed causal attention kernels in `flash.py` (same signatures and layouts of q, k,
v, out and their gradients, and of the log-sum-exp `[H, Q]` passed unchanged from the forward to the backward).

Legend: Q packed query rows, S packed key rows, N sequences, H query heads, G key/value heads (G divides H), K query/key
head dim, V value head dim. Sequence n's queries `[cu_q[n], cu_q[n+1])` attend to its keys
`[cu_k[n], cu_k[n+1])`, causal aligned bottom-right: with h = len_k - len_q, query i sees keys j <= h + i.
Computes in float64 for float64 inputs, float32 otherwise, one sequence at a time.
"""

from __future__ import annotations

import torch

from models.dtypes import upcast

__all__ = ["naive_varlen_forward", "naive_varlen_backward"]


def _sequences(cu_q: torch.Tensor, cu_k: torch.Tensor):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for n in range(len(cq) - 1):
        yield slice(cq[n], cq[n + 1]), slice(ck[n], ck[n + 1])


def _probs_mask(L: int, A: int, device) -> torch.Tensor:
    return torch.arange(A, device=device)[None, :] <= (A - L) + torch.arange(L, device=device)[:, None]


def naive_varlen_forward(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """-> (out `[Q, H, V]` in q's dtype, lse `[H, Q]` float32/float64: log-sum-exp of each row's scaled scores)."""
    dt = upcast(q_QHK.dtype)
    H, group = q_QHK.shape[1], q_QHK.shape[1] // k_SGK.shape[1]
    out = torch.empty(q_QHK.shape[0], H, v_SGV.shape[-1], dtype=q_QHK.dtype, device=q_QHK.device)
    lse = torch.empty(H, q_QHK.shape[0], dtype=dt, device=q_QHK.device)
    for qs, ks in _sequences(cu_q, cu_k):
        q, k, v = q_QHK[qs].to(dt), k_SGK[ks].to(dt), v_SGV[ks].to(dt)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhk,shk->hqs", q, k) * scale
        s = s.masked_fill(~_probs_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
        lse[:, qs] = torch.logsumexp(s, dim=-1)
        out[qs] = torch.einsum("hqs,shk->qhk", torch.exp(s - lse[:, qs, None]), v).to(out.dtype)
    return out, lse


def naive_varlen_backward(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse_HQ, cu_q, cu_k, max_q: int, max_k: int,
                          scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, V]`) in the inputs' dtypes, from the forward's out and lse."""
    dt = upcast(q_QHK.dtype)
    H, G = q_QHK.shape[1], k_SGK.shape[1]
    dq, dk, dv = torch.zeros_like(q_QHK), torch.zeros_like(k_SGK), torch.zeros_like(v_SGV)
    for qs, ks in _sequences(cu_q, cu_k):
        q, do, o = q_QHK[qs].to(dt), dout_QHV[qs].to(dt), out_QHV[qs].to(dt)
        k = k_SGK[ks].to(dt).repeat_interleave(H // G, dim=1)
        v = v_SGV[ks].to(dt).repeat_interleave(H // G, dim=1)
        s = torch.einsum("qhk,shk->hqs", q, k) * scale
        s = s.masked_fill(~_probs_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
        p = torch.exp(s - lse_HQ[:, qs, None].to(dt))
        dp = torch.einsum("qhk,shk->hqs", do, v)
        ds = p * (dp - (do * o).sum(-1).T[:, :, None])
        dq[qs] = (torch.einsum("hqs,shk->qhk", ds, k) * scale).to(dq.dtype)
        dk_h = torch.einsum("hqs,qhk->shk", ds, q) * scale
        dv_h = torch.einsum("hqs,qhk->shk", p, do)
        dk[ks] = dk_h.unflatten(1, (G, H // G)).sum(2).to(dk.dtype)
        dv[ks] = dv_h.unflatten(1, (G, H // G)).sum(2).to(dv.dtype)
    return dq, dk, dv
