"""Expert parallelism over compact rows: routed (row, expert) pairs travel to the rank that holds the expert.

Legend: T compact rows of this rank, k experts per row, M = T k routed pairs, E experts, El = E / ep experts per
rank, D model dim, t = tp degree, r = this rank's tp index.

Each of the ep ranks of a group routes its own compact rows (once per row, as without EP: HARTS §4.2), sorts the
M pairs by expert, and sends the pairs of experts [j El, (j+1) El) to rank j (`all_to_all_rows`, after one
all-to-all of the [ep, El] counts). Rank j runs its El experts on what it received (regrouped by expert), and
the outputs return by the reverse all-to-all; the combine with the routing weights is the one of
`models.moe.Experts`. Backward retraces both all-to-alls. Router statistics stay per rank (they are sums over the
rank's rows, weighted by multiplicity).

The routed weights `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F] become DTensors sharded on the expert dim
over the ep mesh; FSDP2 then shards each rank's El experts over the ranks that hold the same experts (efsdp).

With tensor parallelism (tp > 1) the arrangement is torchtitan 0.3.0's without sequence parallelism
(`torchtitan.models.common.moe_sharding`, EP on, SP off):
- the ep groups are taken from the dp_shard x tp ranks (`parallel.mesh`), so an ep group may contain the tp ranks
  of one replica; those hold the same T rows, so inside the MoE layer rank r routes only its slice
  [r T / t, (r+1) T / t) of them (torchtitan redistributes the MoE input from tp-replicated to sequence-sharded);
  every rank of the dp_shard x tp block then routes different rows, which is what the all-to-all needs;
- routed experts are not tensor-parallel (ETP = 1, the only choice 0.3.0 has: its `expert_parallel_degree`
  "borrows ranks from FSDP and TP", expert weights are sharded on the expert dim over ep alone, and the earlier
  `expert_tensor_parallel_degree` (1 or tp) is gone): each expert's GEMMs run whole on its rank with no collective
  inside, and the tp ranks share the routing work instead of repeating it. ETP = tp would keep rows replicated over
  tp but add a tp reduction of every expert output to the all-to-alls;
- the shared expert is width-sharded as in `parallel.tensor_parallel` (Shard(0) gate/up, Shard(1) down) and runs
  on all T rows, giving a partial sum; the routed output of the slice, zero elsewhere, is a partial sum too, so the
  layer output is one all-reduce over tp of their sum (torchtitan: routed Shard -> Partial, shared Partial,
  Partial -> Replicate at the MoE exit). The layer input enters through f (`copy_to_group`), so the row gradients,
  partial per rank, are summed over tp;
- the router weight and the Qwen3-Next shared-expert gate are replicated with Partial gradients (each rank routes
  different rows; each rank's gate multiplies its partial shared output), summed by FSDP2;
- router statistics of the slices are summed over tp in forward (one all-reduce of [tokens, counts, probability
  mass, z]; backward passes through), so every tp rank sees the replica's statistics and losses built from them
  (z-loss, load balancing) are identical across tp, as without EP; torchtitan sums its expert loads over tp for
  the same reason.

`torchtitan.models.common.moe`'s token dispatchers are not used: they are bound to torchtitan's `GroupedExperts`
(`w1/w2/w3` layout, its Module protocol and local_map regions), while ours keep the transformers layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from models.decoder import HybridForCausalLM
from models.experts import expert_swiglu
from models.moe import Experts, MoE, MoEStats, Routing, dispatch_rows
from models.ops import moe_combine
from parallel.collectives import all_to_all_rows, copy_to_group, reduce_from_group
from parallel.local_params import LocalParams, replicate_param, shard_param, swap_class
from parallel.tensor_parallel import shard_swiglu

__all__ = ["apply_expert_parallel"]


class EPExperts(LocalParams, Experts):
    """`Experts` whose expert computation runs on the ranks holding each expert (see the module docstring)."""

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """As `Experts.forward`: sum over the k chosen experts of weight * expert(x) -> `[T, D]` in x.dtype."""
        T, k = routing.experts.shape
        flat_expert = routing.experts.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts_E = torch.bincount(flat_expert, minlength=self.num_experts)
        slot_of_row = torch.empty_like(order)
        slot_of_row[order] = torch.arange(order.numel(), device=order.device)
        slot_Tk = slot_of_row.view(T, k)
        fused = self.kernels.fused_rowwise
        y_MD = self.dispatched_swiglu(dispatch_rows(x_TD, order // k, slot_Tk, fused), counts_E)
        return moe_combine(y_MD, slot_Tk, routing.weights, fused=fused)

    def dispatched_swiglu(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Pairs `[M, D]` sorted by expert, counts `[E]` -> expert outputs `[M, D]` in the same order."""
        ep = self.ep_group_size
        send_JE = counts_E.view(ep, -1)
        recv_JE = torch.empty_like(send_JE)
        dist.all_to_all_single(recv_JE, send_JE, group=self.ep_group)
        send_splits, recv_splits = send_JE.sum(1).tolist(), recv_JE.sum(1).tolist()
        x_RD = all_to_all_rows(x_MD, send_splits, recv_splits, self.ep_group)
        # Received blocks come by source rank, each sorted by local expert: regroup all of them by local expert.
        El = send_JE.shape[1]
        local_expert = torch.repeat_interleave(torch.arange(El, device=x_RD.device).repeat(ep), recv_JE.reshape(-1))
        perm = torch.argsort(local_expert, stable=True)
        if x_RD.shape[0]:
            y_RD = expert_swiglu(x_RD[perm], self.gate_up_proj, self.down_proj, recv_JE.sum(0),
                                 fused=self.kernels.fused_rowwise)
        else:
            # No pairs for this rank's experts: an empty product with the expert weights keeps the autograd graph
            # as on the other ranks (the backward all-to-alls and FSDP2's gradient reduction must run everywhere).
            gate_RF = F.linear(x_RD, self.gate_up_proj[0]).chunk(2, dim=-1)[0]
            y_RD = F.linear(gate_RF, self.down_proj[0])
        return all_to_all_rows(y_RD[torch.argsort(perm)], recv_splits, send_splits, self.ep_group)


class TPSlicedMoE(LocalParams, MoE):
    """`MoE` under tp x ep: routes this tp rank's slice of the rows (see the module docstring)."""

    def forward(self, x_TD: torch.Tensor, row_weight_T: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        """As `MoE.forward`: x `[T, D]` (the same on every tp rank), row weights `[T]` -> (`[T, D]`, MoEStats),
        both the same on every tp rank."""
        x_TD = copy_to_group(x_TD, self.tp_group)
        T = x_TD.shape[0]
        lo, hi = self.tp_group_rank * T // self.tp_group_size, (self.tp_group_rank + 1) * T // self.tp_group_size
        routing = self.gate(x_TD[lo:hi])
        y_TD = self.plus_shared(F.pad(self.experts(x_TD[lo:hi], routing), (0, 0, lo, T - hi)), x_TD)
        return reduce_from_group(y_TD, self.tp_group), self.summed_stats(routing, row_weight_T, lo, hi)

    def summed_stats(self, routing: Routing, row_weight_T: torch.Tensor | None, lo: int, hi: int) -> MoEStats:
        """Router statistics of rows [lo, hi) summed over the tp group: the statistics of all T rows."""
        logits = routing.logits
        E = logits.shape[1]
        if hi > lo:
            s = self.gate.stats(routing, None if row_weight_T is None else row_weight_T[lo:hi])
            packed = torch.cat([s.tokens[None], s.expert_counts, s.prob_mass, s.z_sum[None]])
        else:  # fewer rows than tp ranks: this rank routes none
            packed = logits.new_zeros(2 * E + 2)
        total = reduce_from_group(packed, self.tp_group)
        return MoEStats(total[0].detach(), total[1 : E + 1].detach(), total[E + 1 : 2 * E + 1], total[-1])


def _slice_rows_over_tp(moe: MoE, mesh: DeviceMesh) -> None:
    swap_class(moe, TPSlicedMoE)
    moe.tp_group = mesh.get_group()
    moe.tp_group_rank = mesh.get_local_rank()
    moe.tp_group_size = mesh.size()
    replicate_param(moe.gate, "weight", mesh)
    if moe.config.shared_expert_gate:
        shard_swiglu(moe.shared_expert, mesh)
        replicate_param(moe.shared_expert_gate, "weight", mesh)
    elif moe.config.shared_expert_intermediate_size:
        shard_swiglu(moe.shared_experts, mesh)


def apply_expert_parallel(model: HybridForCausalLM, mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
    """Shard the routed experts of every MoE layer of `model` over the 1-D ep `mesh` (in place). With a `tp_mesh`
    (tp > 1; `parallel.tensor_parallel` has then left the MoE layers alone) each MoE layer also routes only its tp
    rank's slice of the rows and width-shards its shared expert (see the module docstring)."""
    for layer in model.model.layers:
        if not isinstance(layer.mlp, MoE):
            continue
        experts = layer.mlp.experts
        num_experts = experts.gate_up_proj.shape[0]
        swap_class(experts, EPExperts)
        experts.num_experts = num_experts
        experts.ep_group = mesh.get_group()
        experts.ep_group_size = mesh.size()
        shard_param(experts, "gate_up_proj", mesh, 0)
        shard_param(experts, "down_proj", mesh, 0)
        if tp_mesh is not None:
            _slice_rows_over_tp(layer.mlp, tp_mesh)
