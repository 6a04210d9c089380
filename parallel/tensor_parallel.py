"""Tensor parallelism of the hybrid decoder: head-sharded mixers, width-sharded MLPs, vocabulary-sharded embeddings.

Legend: D model dim, H query/key heads, HV value heads, G key/value heads, K/V head dims, F FFN width, V vocabulary,
W conv width, t = tp degree, r = this rank's tp index.

Every tensor-parallel region takes replicated rows and returns replicated rows: its entry step applies f
(`copy_to_group`), its exit step g (`reduce_from_group`); in between each rank runs the unmodified model code on
its own heads with local parameters (`parallel.local_params`) and a config whose head counts are divided by t.

Sharding per mixer (Shard(0) of a projection = its output features, Shard(1) = its input features):
- GDN (Qwen3-Next): `in_proj_qkvz` [H (2K + 2 HV/H V), D] and `in_proj_ba` [2 HV, D] are laid out per key head,
  so Shard(0) gives rank r whole key heads [r H/t, (r+1) H/t) with their value heads; `dt_bias`, `A_log` [HV]
  Shard(0) follow the same value heads; the conv over [q | k | v] stays replicated and rank r reads the channels of
  its heads in each of q, k, v; the gated norm weight [V] is replicated; `out_proj` Shard(1).
- KDA (Kimi-Linear): `q_proj`, `k_proj`, `v_proj`, `f_b_proj`, `g_b_proj` [H K, *] and `b_proj` [H, D] Shard(0),
  `forget_gate.dt_bias` [H K] Shard(0), `forget_gate.A_log` [1, 1, H, 1] Shard(2); the low-rank gate inputs
  `f_a_proj`, `g_a_proj` [K, D], the conv and the norm weight [K] replicated; `o_proj` Shard(1).
- Gated attention: `q_proj` (per head query then gate) and `k_proj`, `v_proj` Shard(0) (t must divide G);
  q/k norms replicated; `o_proj` Shard(1).
- MLA: per-head `q_proj` / `q_b_proj` and `kv_b_proj` Shard(0); the latent projections and norms replicated;
  `o_proj` Shard(1).
- SwiGLU (dense FFN and shared experts): `gate_proj`, `up_proj` Shard(0), `down_proj` Shard(1).
- Embedding and LM head: Shard(0) over the vocabulary (see `parallel.vocab_parallel`).
Replicated parameters read in part get Partial gradients (summed over tp by FSDP2). Everything else (layer norms,
routers, routed experts, the shared-expert gate) stays a plain tensor computed identically on every tp rank.
Under expert parallelism (ep > 1) the MoE layers are left to `parallel.expert_parallel`, which splits their rows
over tp and shards the shared expert with `shard_swiglu`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.decoder import HybridForCausalLM
from models.ffn import SwiGLU
from models.gated_attention import GatedAttention
from models.gdn import GatedDeltaNet
from models.kda import KimiDeltaAttention
from models.mla import MLA
from models.moe import MoE
from parallel.collectives import copy_to_group, reduce_from_group
from parallel.local_params import LocalParams, replicate_param, shard_param, swap_class

__all__ = ["apply_tensor_parallel", "shard_swiglu"]


class TPGatedDeltaNet(LocalParams, GatedDeltaNet):
    def project(self, x_TD):
        return super().project(copy_to_group(x_TD, self.tp_group))

    def output(self, o, rows):
        return reduce_from_group(super().output(o, rows), self.tp_group)


class TPKimiDeltaAttention(LocalParams, KimiDeltaAttention):
    def project(self, x_TD):
        return super().project(copy_to_group(x_TD, self.tp_group))

    def output(self, o, rows):
        return reduce_from_group(super().output(o, rows), self.tp_group)


class TPGatedAttention(LocalParams, GatedAttention):
    def project(self, x_TD, position_ids_T):
        return super().project(copy_to_group(x_TD, self.tp_group), position_ids_T)

    def output(self, o, rows):
        return reduce_from_group(super().output(o, rows), self.tp_group)


class TPMLA(LocalParams, MLA):
    def latents(self, x_TD, position_ids_T):
        return super().latents(copy_to_group(x_TD, self.tp_group), position_ids_T)

    def output(self, o, rows):
        return reduce_from_group(super().output(o, rows), self.tp_group)


class TPSwiGLU(LocalParams, SwiGLU):
    def forward(self, x_TD):
        return reduce_from_group(super().forward(copy_to_group(x_TD, self.tp_group)), self.tp_group)


class TPEmbedding(LocalParams, nn.Embedding):
    """Rank r holds rows [r V/t, (r+1) V/t) of the table; ids outside give zeros; the sum over ranks is the lookup."""

    def forward(self, ids):
        weight = self.weight
        start = self.tp_group_rank * weight.shape[0]
        local = ids - start
        inside = (local >= 0) & (local < weight.shape[0])
        x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside[..., None].to(weight.dtype)
        return reduce_from_group(x, self.tp_group)


def _heads(r: int, t: int, width: int) -> torch.Tensor:
    """Indices of slice r of t equal slices of [0, width)."""
    n = width // t
    return torch.arange(r * n, (r + 1) * n)


def _conv_rows(r: int, t: int, qk_width: int, v_width: int) -> torch.Tensor:
    """Rank r's channels of a conv over [q (qk_width) | k (qk_width) | v (v_width)]: its slice of each part."""
    return torch.cat([_heads(r, t, qk_width), qk_width + _heads(r, t, qk_width), 2 * qk_width + _heads(r, t, v_width)])


def _enter_region(module: nn.Module, cls: type, mesh: DeviceMesh) -> None:
    swap_class(module, cls)
    module.tp_group = mesh.get_group()
    module.tp_group_rank = mesh.get_local_rank()


def _gdn(m: GatedDeltaNet, mesh: DeviceMesh) -> None:
    c, t, r = m.config, mesh.size(), mesh.get_local_rank()
    _enter_region(m, TPGatedDeltaNet, mesh)
    for lin in (m.in_proj_qkvz, m.in_proj_ba):
        shard_param(lin, "weight", mesh, 0)
    shard_param(m, "dt_bias", mesh, 0)
    shard_param(m, "A_log", mesh, 0)
    conv_rows = _conv_rows(r, t, c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim)
    replicate_param(m.conv1d, "weight", mesh, conv_rows)
    replicate_param(m.norm, "weight", mesh)
    shard_param(m.out_proj, "weight", mesh, 1)
    m.config = dataclasses.replace(c, num_k_heads=c.num_k_heads // t, num_v_heads=c.num_v_heads // t)


def _kda(m: KimiDeltaAttention, mesh: DeviceMesh) -> None:
    c, t, r = m.config, mesh.size(), mesh.get_local_rank()
    _enter_region(m, TPKimiDeltaAttention, mesh)
    fg = m.forget_gate
    for lin in (m.q_proj, m.k_proj, m.v_proj, m.b_proj, fg.f_b_proj, m.g_b_proj):
        shard_param(lin, "weight", mesh, 0)
    shard_param(fg, "dt_bias", mesh, 0)
    shard_param(fg, "A_log", mesh, 2)
    for lin in (fg.f_a_proj, m.g_a_proj):
        replicate_param(lin, "weight", mesh)
    HK = c.num_heads * c.head_dim
    replicate_param(m.conv1d, "weight", mesh, _conv_rows(r, t, HK, HK))
    replicate_param(m.o_norm, "weight", mesh)
    shard_param(m.o_proj, "weight", mesh, 1)
    m.config = dataclasses.replace(c, num_heads=c.num_heads // t)


def _gated_attention(m: GatedAttention, mesh: DeviceMesh) -> None:
    c, t = m.config, mesh.size()
    _enter_region(m, TPGatedAttention, mesh)
    for lin in (m.q_proj, m.k_proj, m.v_proj):
        shard_param(lin, "weight", mesh, 0)
    for norm in (m.q_norm, m.k_norm):
        replicate_param(norm, "weight", mesh)
    shard_param(m.o_proj, "weight", mesh, 1)
    m.config = dataclasses.replace(c, num_heads=c.num_heads // t, num_kv_heads=c.num_kv_heads // t)


def _mla(m: MLA, mesh: DeviceMesh) -> None:
    c, t = m.config, mesh.size()
    _enter_region(m, TPMLA, mesh)
    if c.q_lora_rank is None:
        shard_param(m.q_proj, "weight", mesh, 0)
    else:
        replicate_param(m.q_a_proj, "weight", mesh)
        replicate_param(m.q_a_layernorm, "weight", mesh)
        shard_param(m.q_b_proj, "weight", mesh, 0)
    replicate_param(m.kv_a_proj_with_mqa, "weight", mesh)
    replicate_param(m.kv_a_layernorm, "weight", mesh)
    shard_param(m.kv_b_proj, "weight", mesh, 0)
    shard_param(m.o_proj, "weight", mesh, 1)
    m.config = dataclasses.replace(c, num_heads=c.num_heads // t)


def shard_swiglu(m: SwiGLU, mesh: DeviceMesh) -> None:
    """Width-shard `m` over `mesh` without a region of its own: on `[T, D]` rows it returns this rank's partial
    sum `[T, D]` (its F / t hidden units), which the caller reduces over the group."""
    swap_class(m)
    shard_param(m.gate_proj, "weight", mesh, 0)
    shard_param(m.up_proj, "weight", mesh, 0)
    shard_param(m.down_proj, "weight", mesh, 1)


def _swiglu(m: SwiGLU, mesh: DeviceMesh) -> None:
    _enter_region(m, TPSwiGLU, mesh)
    shard_swiglu(m, mesh)


_MIXERS = {GatedDeltaNet: _gdn, KimiDeltaAttention: _kda, GatedAttention: _gated_attention, MLA: _mla}


def apply_tensor_parallel(model: HybridForCausalLM, mesh: DeviceMesh, moe_layers: bool = True) -> None:
    """Shard `model` in place over the 1-D tp `mesh` (see the module docstring); `moe_layers=False` (ep > 1) leaves
    the MoE layers to `parallel.expert_parallel`. Degrees are checked by `ParallelConfig.validate`."""
    _enter_region(model.model.embed_tokens, TPEmbedding, mesh)
    shard_param(model.model.embed_tokens, "weight", mesh, 0)
    if not model.config.tie_word_embeddings:
        shard_param(model.lm_head, "weight", mesh, 0)
    for layer in model.model.layers:
        _MIXERS[type(layer.mixer)](layer.mixer, mesh)
        if not isinstance(layer.mlp, MoE):
            _swiglu(layer.mlp, mesh)
        elif moe_layers:
            shared = getattr(layer.mlp, "shared_expert", None) or getattr(layer.mlp, "shared_experts", None)
            if shared is not None:
                _swiglu(shared, mesh)
