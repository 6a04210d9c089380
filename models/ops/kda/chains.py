"""A round's two chunk-state recurrences in one launch each: every sequence of the round runs its pieces (cut at
chunk boundaries, each piece a call's rows: `models.ops.kda.call_arrays.ChainArrays`) one after the other in one
program, the state in registers, and writes its state at the end of every piece into the layer's state table.

Legend: T the layer's calls' rows, NT their chunks, M state-table entries, N_r sequences of the round, P_r their
pieces, H query/key heads, HV value heads, K/V head dims (K <= 256, in blocks of 64).

The kernels are fla 0.6.0's `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` and
`chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64` (`fla/ops/common/chunk_delta_h.py`) with our flags (per-channel
gate `gk`, K-first fp32 states, varlen, new values saved), the same operations on the same operands per chunk, only
the loop over a sequence's chunks runs over its pieces' chunks. Call by call, piece j+1 starts from the fp32 state
piece j wrote into the table; here it continues from the registers that held it, so the forward's chunk states, new
values and table entries are the same bits (`tests/models/ops/test_kda_calls.py`; its GPU runs: bench/RESULTS.md,
"GPU: CUDA tests").

Backward walks the pieces in reverse: before a piece's last chunk it adds the gradient of the piece's table entry
(what later rounds' sequences starting from it, and the caller, gave it) to the state gradient in registers; call by
call that entry's gradient also held the next piece's initial-state gradient, added in the other order, so these
gradients agree to rounding where a side branch starts from the entry and bitwise otherwise. Each sequence's
initial-state gradient is written to `dh0` `[N_r, HV, K, V]`; the caller adds it to the table's gradient.

Launch configs: BV and warps/stages of the stock kernels' tuned entries for flat's calls on this GPU
(`models.ops.tuned_configs`), so tree and flat run the same tiles; where fla would autotune instead, the caller runs
the stock kernels call by call (`models.ops.kda.tree_calls`). Zeros: fla adds an initial state to a literal zero (so a
-0 entry reads as +0); a chain's later pieces continue from registers, as flat's uncut sequences do.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from fla.ops.utils.op import exp2

from models.ops.tuned_configs import CONFIG_DIR_ENV

if TYPE_CHECKING:
    from models.ops.kda.call_arrays import ChainArrays

__all__ = ["bwd_config", "bwd_dhu_chains", "fwd_config", "fwd_h_chains", "launch_config"]


@triton.jit
def _program(HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """This program's (sequence, head) index i_nh, sequence i_n, head i_h, and its value columns o_v with their mask
    (fla's grid: value blocks fastest)."""
    pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v, i_nh = pid % NV, (pid // NV).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    return i_nh, i_nh // HV, i_nh % HV, o_v, o_v < V


@triton.jit
def _key_blocks(K: tl.constexpr):
    """The rows of the state's four blocks of 64 keys and their masks (blocks past K are masked out, unused)."""
    o_k1 = tl.arange(0, 64)
    return o_k1, o_k1 < K, 64 + o_k1, 64 + o_k1 < K, 128 + o_k1, 128 + o_k1 < K, 192 + o_k1, 192 + o_k1 < K


@triton.jit
def _state_block(p, o_k, m_k, o_v, m_v, V: tl.constexpr):
    """Pointers and mask of the `[64, BV]` block (rows o_k, columns o_v) of a K-first `[K, V]` state at p."""
    return p + o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def _load_state(p, o_k, m_k, o_v, m_v, V: tl.constexpr):
    p_s, m_s = _state_block(p, o_k, m_k, o_v, m_v, V)
    return tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)


@triton.jit
def _store_state(p, b_s, o_k, m_k, o_v, m_v, V: tl.constexpr):
    p_s, m_s = _state_block(p, o_k, m_k, o_v, m_v, V)
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_s)


@triton.jit
def _store_states(p, b1, b2, b3, b4, o_v, m_v, K: tl.constexpr, V: tl.constexpr):
    """Store the blocks b1..b4 (`[64, BV]` each, those within K) of a K-first `[K, V]` state at p."""
    o_k1, m_k1, o_k2, m_k2, o_k3, m_k3, o_k4, m_k4 = _key_blocks(K)
    _store_state(p, b1, o_k1, m_k1, o_v, m_v, V)
    if K > 64:
        _store_state(p, b2, o_k2, m_k2, o_v, m_v, V)
    if K > 128:
        _store_state(p, b3, o_k3, m_k3, o_v, m_v, V)
    if K > 192:
        _store_state(p, b4, o_k4, m_k4, o_v, m_v, V)


@triton.jit
def _add_states(p, b1, b2, b3, b4, o_v, m_v, K: tl.constexpr, V: tl.constexpr):
    """b1..b4 plus the blocks of the K-first `[K, V]` state at p (fp32), as fla adds an initial state or `dht`."""
    o_k1, m_k1, o_k2, m_k2, o_k3, m_k3, o_k4, m_k4 = _key_blocks(K)
    b1 += _load_state(p, o_k1, m_k1, o_v, m_v, V)
    if K > 64:
        b2 += _load_state(p, o_k2, m_k2, o_v, m_v, V)
    if K > 128:
        b3 += _load_state(p, o_k3, m_k3, o_v, m_v, V)
    if K > 192:
        b4 += _load_state(p, o_k4, m_k4, o_v, m_v, V)
    return b1, b2, b3, b4


@triton.jit
def chain_fwd_kernel_h(k, u, w, v_new, gk, h, table, chain_pieces, piece_bos, piece_eos, piece_boh, piece_state,
                       chain_init, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BV: tl.constexpr, STORE_STATES: tl.constexpr):
    """Program (i_v, sequence i_n, head i_h): k `[1, T, H, K]` (gated keys), u, v_new `[1, T, HV, V]`, w
    `[1, T, HV, K]`, gk `[1, T, HV, K]` (chunk-local cumsum, log2), h `[1, NT, HV, K, V]`, table `[M, HV, K, V]`
    fp32; chain_pieces `[N_r+1]` (each sequence's pieces), piece_bos/eos `[P_r]` (rows), piece_boh `[P_r]` (first
    chunk), piece_state `[P_r]` (table entry of the state after the piece), chain_init `[N_r]` (entry it starts
    from; entry 0 holds zeros)."""
    i_nh, i_n, i_h, o_v, m_v = _program(HV, V, BV)
    o_k1, m_k1, o_k2, m_k2, o_k3, m_k3, o_k4, m_k4 = _key_blocks(K)

    p_h0 = table + (tl.load(chain_init + i_n).to(tl.int64) * HV + i_h) * K*V
    b_h1, b_h2, b_h3, b_h4 = _add_states(p_h0, tl.zeros([64, BV], dtype=tl.float32),
                                         tl.zeros([64, BV], dtype=tl.float32), tl.zeros([64, BV], dtype=tl.float32),
                                         tl.zeros([64, BV], dtype=tl.float32), o_v, m_v, K, V)

    for i_p in range(tl.load(chain_pieces + i_n), tl.load(chain_pieces + i_n + 1)):
        bos = tl.load(piece_bos + i_p).to(tl.int64)
        T = tl.load(piece_eos + i_p).to(tl.int64) - bos
        NT = tl.cdiv(T, BT)
        p_h = h + (tl.load(piece_boh + i_p).to(tl.int64) * HV + i_h) * K*V
        p_u = u + (bos * HV + i_h) * V
        p_k = k + (bos * H + i_h // (HV // H)) * K
        p_w = w + (bos * HV + i_h) * K
        p_vn = v_new + (bos * HV + i_h) * V
        p_gk = gk + (bos * HV + i_h) * K
        for i_t in range(NT):
            i_t64 = tl.cast(i_t, tl.int64)
            o_t = i_t64 * BT + tl.arange(0, BT)
            m_t = o_t < T
            p_hc = p_h + i_t64 * HV*K*V
            _store_states(p_hc, b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V)

            b_w = tl.load(p_w + o_t[:, None] * (HV*K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
            b_v = tl.dot(b_w, b_h1.to(b_w.dtype))
            if K > 64:
                b_w = tl.load(p_w + o_t[:, None] * (HV*K) + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :],
                              other=0.0)
                b_v = tl.dot(b_w, b_h2.to(b_w.dtype), b_v)
            if K > 128:
                b_w = tl.load(p_w + o_t[:, None] * (HV*K) + o_k3[None, :], mask=m_t[:, None] & m_k3[None, :],
                              other=0.0)
                b_v = tl.dot(b_w, b_h3.to(b_w.dtype), b_v)
            if K > 192:
                b_w = tl.load(p_w + o_t[:, None] * (HV*K) + o_k4[None, :], mask=m_t[:, None] & m_k4[None, :],
                              other=0.0)
                b_v = tl.dot(b_w, b_h4.to(b_w.dtype), b_v)
            b_v = tl.load(p_u + o_t[:, None] * (HV*V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                          other=0.0) - b_v
            p_v = p_vn + o_t[:, None] * (HV*V) + o_v[None, :]
            tl.store(p_v, b_v.to(p_v.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

            last_idx = tl.minimum((i_t64 + 1) * BT, T) - 1
            b_gk_last1 = tl.load(p_gk + last_idx * HV*K + o_k1, mask=(o_k1 < K), other=0.).to(tl.float32)
            b_h1 *= exp2(b_gk_last1)[:, None]
            if K > 64:
                b_gk_last2 = tl.load(p_gk + last_idx * HV*K + o_k2, mask=(o_k2 < K), other=0.).to(tl.float32)
                b_h2 *= exp2(b_gk_last2)[:, None]
            if K > 128:
                b_gk_last3 = tl.load(p_gk + last_idx * HV*K + o_k3, mask=(o_k3 < K), other=0.).to(tl.float32)
                b_h3 *= exp2(b_gk_last3)[:, None]
            if K > 192:
                b_gk_last4 = tl.load(p_gk + last_idx * HV*K + o_k4, mask=(o_k4 < K), other=0.).to(tl.float32)
                b_h4 *= exp2(b_gk_last4)[:, None]
            b_v = b_v.to(k.dtype.element_ty)

            b_k = tl.load(p_k + o_k1[:, None] + o_t[None, :] * (H*K), mask=m_k1[:, None] & m_t[None, :], other=0.0)
            b_h1 = tl.dot(b_k, b_v, b_h1)
            if K > 64:
                b_k = tl.load(p_k + o_k2[:, None] + o_t[None, :] * (H*K), mask=m_k2[:, None] & m_t[None, :],
                              other=0.0)
                b_h2 = tl.dot(b_k, b_v, b_h2)
            if K > 128:
                b_k = tl.load(p_k + o_k3[:, None] + o_t[None, :] * (H*K), mask=m_k3[:, None] & m_t[None, :],
                              other=0.0)
                b_h3 = tl.dot(b_k, b_v, b_h3)
            if K > 192:
                b_k = tl.load(p_k + o_k4[:, None] + o_t[None, :] * (H*K), mask=m_k4[:, None] & m_t[None, :],
                              other=0.0)
                b_h4 = tl.dot(b_k, b_v, b_h4)

        if STORE_STATES:
            p_ht = table + (tl.load(piece_state + i_p).to(tl.int64) * HV + i_h) * K*V
            _store_states(p_ht, b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V)


@triton.jit
def _dh_update(b_dh, p_q, p_w, o_k, m_k, o_t, m_t, b_do, b_dv, b_gk_last, scale, H: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr):
    """One `[64, BV]` block of the state gradient carried one chunk back (fla's dh update, K-first, gk only)."""
    b_w = tl.load(p_w + o_k[:, None] + o_t[None, :] * (HV*K), mask=m_k[:, None] & m_t[None, :], other=0.0)
    b_q = tl.load(p_q + o_k[:, None] + o_t[None, :] * (H*K), mask=m_k[:, None] & m_t[None, :], other=0.0)
    b_dh *= exp2(b_gk_last[:, None])
    b_dh += tl.dot(b_q.to(b_q.dtype), b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
    return b_dh


@triton.jit
def chain_bwd_kernel_dhu(q, k, w, gk, d_table, dh0, do, dh, dv, dv2, chain_pieces, piece_bos, piece_eos, piece_boh,
                         piece_state, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BV: tl.constexpr):
    """Program (i_v, sequence i_n, head i_h): q, k `[1, T, H, K]` (gated), w `[1, T, HV, K]`, gk `[1, T, HV, K]`,
    do, dv, dv2 `[1, T, HV, V]`, dh `[1, NT, HV, K, V]`, d_table `[M, HV, K, V]` fp32 (read), dh0 `[N_r, HV, K, V]`
    fp32 (written); the chain arrays as `chain_fwd_kernel_h`."""
    i_nh, i_n, i_h, o_v, m_v = _program(HV, V, BV)
    o_k1, m_k1, o_k2, m_k2, o_k3, m_k3, o_k4, m_k4 = _key_blocks(K)

    b_dh1 = tl.zeros([64, BV], dtype=tl.float32)
    b_dh2 = tl.zeros([64, BV], dtype=tl.float32)
    b_dh3 = tl.zeros([64, BV], dtype=tl.float32)
    b_dh4 = tl.zeros([64, BV], dtype=tl.float32)

    p_first = tl.load(chain_pieces + i_n)
    for i_r in range(tl.load(chain_pieces + i_n + 1) - p_first):
        i_p = tl.load(chain_pieces + i_n + 1) - 1 - i_r
        p_dht = d_table + (tl.load(piece_state + i_p).to(tl.int64) * HV + i_h) * K*V
        b_dh1, b_dh2, b_dh3, b_dh4 = _add_states(p_dht, b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V)

        bos = tl.load(piece_bos + i_p).to(tl.int64)
        T = tl.load(piece_eos + i_p).to(tl.int64) - bos
        NT = tl.cdiv(T, BT)
        p_dh = dh + (tl.load(piece_boh + i_p).to(tl.int64) * HV + i_h) * K*V
        p_q = q + (bos * H + i_h // (HV // H)) * K
        p_k = k + (bos * H + i_h // (HV // H)) * K
        p_w = w + (bos * HV + i_h) * K
        p_do = do + (bos * HV + i_h) * V
        p_dv = dv + (bos * HV + i_h) * V
        p_dv2 = dv2 + (bos * HV + i_h) * V
        p_gk = gk + (bos * HV + i_h) * K
        for i_s in range(NT):
            i_t64 = tl.cast(NT - 1 - i_s, tl.int64)
            o_t = i_t64 * BT + tl.arange(0, BT)
            m_t = o_t < T
            p_dhc = p_dh + i_t64 * HV*K*V
            _store_states(p_dhc, b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V)

            last_idx = tl.minimum((i_t64 + 1) * BT, T) - 1
            b_do = tl.load(p_do + o_t[:, None] * (HV*V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_k = tl.load(p_k + o_t[:, None] * (H*K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
            b_gk_last1 = tl.load(p_gk + last_idx * HV*K + o_k1, mask=(o_k1 < K), other=0.).to(tl.float32)
            b_dv = tl.dot(b_k, b_dh1.to(b_k.dtype))
            if K > 64:
                b_k = tl.load(p_k + o_t[:, None] * (H*K) + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :],
                              other=0.0)
                b_gk_last2 = tl.load(p_gk + last_idx * HV*K + o_k2, mask=(o_k2 < K), other=0.).to(tl.float32)
                b_dv = tl.dot(b_k, b_dh2.to(b_k.dtype), b_dv)
            if K > 128:
                b_k = tl.load(p_k + o_t[:, None] * (H*K) + o_k3[None, :], mask=m_t[:, None] & m_k3[None, :],
                              other=0.0)
                b_gk_last3 = tl.load(p_gk + last_idx * HV*K + o_k3, mask=(o_k3 < K), other=0.).to(tl.float32)
                b_dv = tl.dot(b_k, b_dh3.to(b_k.dtype), b_dv)
            if K > 192:
                b_k = tl.load(p_k + o_t[:, None] * (H*K) + o_k4[None, :], mask=m_t[:, None] & m_k4[None, :],
                              other=0.0)
                b_gk_last4 = tl.load(p_gk + last_idx * HV*K + o_k4, mask=(o_k4 < K), other=0.).to(tl.float32)
                b_dv = tl.dot(b_k, b_dh4.to(b_k.dtype), b_dv)
            p_v = p_dv + o_t[:, None] * (HV*V) + o_v[None, :]
            b_dv += tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
            tl.store(p_dv2 + o_t[:, None] * (HV*V) + o_v[None, :], b_dv.to(p_v.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])

            b_dh1 = _dh_update(b_dh1, p_q, p_w, o_k1, m_k1, o_t, m_t, b_do, b_dv, b_gk_last1, scale, H, HV, K)
            if K > 64:
                b_dh2 = _dh_update(b_dh2, p_q, p_w, o_k2, m_k2, o_t, m_t, b_do, b_dv, b_gk_last2, scale, H, HV, K)
            if K > 128:
                b_dh3 = _dh_update(b_dh3, p_q, p_w, o_k3, m_k3, o_t, m_t, b_do, b_dv, b_gk_last3, scale, H, HV, K)
            if K > 192:
                b_dh4 = _dh_update(b_dh4, p_q, p_w, o_k4, m_k4, o_t, m_t, b_do, b_dv, b_gk_last4, scale, H, HV, K)

    p_dh0 = dh0 + i_nh * K*V
    _store_states(p_dh0, b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V)


_STOCK_KERNELS = {"fwd": "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                  "bwd": "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"}


def fwd_config(k: torch.Tensor, u: torch.Tensor, gk: torch.Tensor, chunk_size: int) -> dict | None:
    """The launch config (BV, num_warps, num_stages) of the stock forward kernel for flat's call with these inputs
    (`launch_config`): k `[1, T, H, K]`, u `[1, T, HV, V]`, gk `[1, T, HV, K]`; None where none is tuned."""
    H, K, HV, V = k.shape[2], k.shape[3], u.shape[2], u.shape[3]
    # fla's key: H, HV, K, V, BT, STATE_V_FIRST, then the dtypes of the tensors flat's chunk_kda passes: k, v (= u),
    # w (k's dtype), v_new (u's), gk, h (k's), cu_seqlens, chunk_offsets.
    dtypes = (k.dtype, u.dtype, k.dtype, u.dtype, gk.dtype, k.dtype, torch.int64, torch.int64)
    return launch_config("fwd", (H, HV, K, V, chunk_size, False, *map(str, dtypes)))


def bwd_config(q: torch.Tensor, do: torch.Tensor, gk: torch.Tensor, chunk_size: int) -> dict | None:
    """As `fwd_config` for the stock backward kernel: q `[1, T, H, K]` (its dtype also k's, w's and dh's), do
    `[1, T, HV, V]` (also dv's and dv2's), gk `[1, T, HV, K]`."""
    H, K, HV, V = q.shape[2], q.shape[3], do.shape[2], do.shape[3]
    # fla's key: H, HV, K, V, BT, USE_G, STATE_V_FIRST, then the dtypes of q, k, w, gk, do, dh, dv, dv2, cu_seqlens,
    # chunk_offsets (flat's call passes neither h0 nor dht).
    dtypes = (q.dtype, q.dtype, q.dtype, gk.dtype, do.dtype, q.dtype, do.dtype, do.dtype, torch.int64, torch.int64)
    return launch_config("bwd", (H, HV, K, V, chunk_size, False, False, *map(str, dtypes)))


def launch_config(direction: str, key: tuple) -> dict | None:
    """BV, num_warps and num_stages that fla's stock kernel of `direction` ('fwd' or 'bwd') runs with for autotuning
    key `key`, as fla looks it up in its config folder (`fla.ops.utils.cache.load_cached_config`: `FLA_CONFIG_DIR`,
    which `models.ops.tuned_configs.use_tuned_configs` sets for a GPU with a tuned folder, in the `FLA_CACHE_MODE`
    fla was imported with). None without one: fla then autotunes the stock kernel, and the chain kernel could not
    know the tiles it chose, so the caller runs the stock kernels call by call. Looked up once per folder and key."""
    return _cached_config(os.environ.get(CONFIG_DIR_ENV), _STOCK_KERNELS[direction], key)


@functools.lru_cache(maxsize=None)
def _cached_config(folder: str | None, kernel: str, key: tuple) -> dict | None:
    from fla.ops.utils.cache import AutotuneKey, load_cached_config

    config = load_cached_config(kernel, AutotuneKey(key))
    if config is None:
        return None
    return {"BV": config["kwargs"]["BV"], "num_warps": config["num_warps"], "num_stages": config["num_stages"]}


def fwd_h_chains(h: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                 gk: torch.Tensor, table: torch.Tensor, chains: ChainArrays, chunk_size: int, store_states: bool,
                 config: dict) -> None:
    """One round's forward recurrence: the chunk states of its pieces into h `[1, NT, HV, K, V]` and their new values
    into v_new `[1, T, HV, V]` (the layer's buffers, k's dtype), each sequence starting from its `chains.init` entry
    of table `[M, HV, K, V]` fp32 and, with `store_states`, the state after each piece written to its entry.
    k `[1, T, H, K]` (gated keys), w `[1, T, HV, K]`, u `[1, T, HV, V]`, gk `[1, T, HV, K]` (chunk cumsum, log2);
    config: BV, num_warps, num_stages (`fwd_config`)."""
    _, _, H, K = k.shape
    HV, V = u.shape[2], u.shape[-1]
    assert h.is_contiguous() and h.dtype == k.dtype and v_new.is_contiguous() and v_new.dtype == u.dtype
    assert table.is_contiguous() and table.dtype == torch.float32
    BV = config["BV"]
    chain_fwd_kernel_h[(triton.cdiv(V, BV) * chains.num_sequences * HV,)](
        k, u, w, v_new, gk, h, table, chains.pieces, chains.piece_bos, chains.piece_eos, chains.piece_boh,
        chains.piece_state, chains.init, H=H, HV=HV, K=K, V=V, BT=chunk_size, BV=BV, STORE_STATES=store_states,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def bwd_dhu_chains(dh: torch.Tensor, dv2: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                   do: torch.Tensor, dv: torch.Tensor, gk: torch.Tensor, d_table: torch.Tensor, scale: float,
                   chains: ChainArrays, chunk_size: int, config: dict) -> torch.Tensor:
    """One round's backward recurrence: the chunk-state gradients of its pieces into dh `[1, NT, HV, K, V]` (q's
    dtype) and their value gradients into dv2 `[1, T, HV, V]` (dv's dtype), reading each piece's entry of d_table
    `[M, HV, K, V]` fp32. Returns each sequence's initial-state gradient `[N_r, HV, K, V]` fp32. q, k `[1, T, H, K]`
    (gated), w `[1, T, HV, K]`, do, dv `[1, T, HV, V]`, gk `[1, T, HV, K]`; config as `bwd_config`'s."""
    _, _, H, K = q.shape
    HV, V = do.shape[2], do.shape[-1]
    assert dh.is_contiguous() and dh.dtype == q.dtype and dv2.is_contiguous() and dv2.dtype == dv.dtype
    assert d_table.is_contiguous() and d_table.dtype == torch.float32
    dh0 = d_table.new_empty(chains.num_sequences, HV, K, V)
    BV = config["BV"]
    chain_bwd_kernel_dhu[(triton.cdiv(V, BV) * chains.num_sequences * HV,)](
        q, k, w, gk, d_table, dh0, do, dh, dv, dv2, chains.pieces, chains.piece_bos, chains.piece_eos,
        chains.piece_boh, chains.piece_state, scale, H=H, HV=HV, K=K, V=V, BT=chunk_size, BV=BV,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return dh0
