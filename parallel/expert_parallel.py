"""Expert parallelism over compact rows: routed (row, expert) pairs travel to the rank that holds the expert.

Legend: T compact rows of this rank, k experts per row, M = T k routed pairs, E experts, El = E / ep experts per
rank, D model dim.

Each of the ep ranks of a group routes its own compact rows (once per row, as without EP: HARTS §4.2), sorts the
M pairs by expert, and sends the pairs of experts [j El, (j+1) El) to rank j (`all_to_all_rows`, after one
all-to-all of the [ep, El] counts). Rank j runs its El experts on what it received (regrouped by expert), and
the outputs return by the reverse all-to-all; the combine with the routing weights is the one of
`models.moe.Experts`. Backward retraces both all-to-alls. Router statistics stay per rank (they are sums over the
rank's rows, weighted by multiplicity).

The routed weights `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F] become DTensors sharded on the expert dim
over the ep mesh; FSDP2 then shards each rank's El experts over the replicas that hold the same experts.

`torchtitan.models.common.moe`'s token dispatchers are not used: they are bound to torchtitan's `GroupedExperts`
(`w1/w2/w3` layout, its Module protocol and local_map regions), while ours keep the transformers layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from models.decoder import HybridForCausalLM
from models.dtypes import upcast
from models.experts import expert_swiglu
from models.moe import Experts, MoE, Routing
from parallel.collectives import all_to_all_rows
from parallel.local_params import LocalParams, shard_param, swap_class

__all__ = ["apply_expert_parallel"]


class EPExperts(LocalParams, Experts):
    """`Experts` whose expert computation runs on the ranks holding each expert (see the module docstring)."""

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """As `Experts.forward`: sum over the k chosen experts of weight * expert(x) -> `[T, D]` in x.dtype."""
        T, k = routing.experts.shape
        flat_expert = routing.experts.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts_E = torch.bincount(flat_expert, minlength=self.num_experts)
        y_MD = self.dispatched_swiglu(x_TD[order // k], counts_E)
        slot_of_row = torch.empty_like(order)
        slot_of_row[order] = torch.arange(order.numel(), device=order.device)
        y_TkD = y_MD[slot_of_row].view(T, k, -1) * routing.weights.to(x_TD.dtype)[:, :, None]
        return y_TkD.sum(1, dtype=upcast(x_TD.dtype)).to(x_TD.dtype)

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
        y_RD = expert_swiglu(x_RD[perm], self.gate_up_proj, self.down_proj, recv_JE.sum(0))
        return all_to_all_rows(y_RD[torch.argsort(perm)], recv_splits, send_splits, self.ep_group)


def apply_expert_parallel(model: HybridForCausalLM, mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE layer of `model` over the 1-D ep `mesh` (in place)."""
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
