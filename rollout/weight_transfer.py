"""Weight sync to a vLLM engine on other GPUs through vLLM's native weight-transfer API (NCCL backend).

`VLLMEngine.update_weights` covers engines inside the trainer's process. When the engine is a separate vLLM server
(its own GPUs or nodes), the trainer broadcasts HF checkpoint-format tensors over an NCCL group that it forms with the
server's workers; vLLM drives start/update/finish of a layerwise reload on its side.

Server: `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'` (dev mode exposes
`/reset_prefix_cache`). Trainer (rank 0 sends; every trainer rank constructs the sender and calls `send`):

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    sender = NCCLWeightSender(export_hf_tensors, client=HTTPVLLMWeightSyncClient(url), master_address=host,
                              master_port=29600, world_size=1 + server_gpus, rank=rank,
                              reset_prefix_cache=lambda: requests.post(f"{url}/reset_prefix_cache").raise_for_status())
    sender.send()   # after every optimizer step

Not tested in this repository (needs CUDA and NCCL): everything but `NamedTensorSource`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient, WeightSource, materialize_full_tensor

__all__ = ["NamedTensorSource", "NCCLWeightSender"]

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class NamedTensorSource(WeightSource):
    """A vLLM `WeightSource` over a function that yields HF checkpoint-format (name, tensor) pairs.

    The function is called once per transfer and must yield the same names, dtypes and shapes in the same order each
    time; DTensors are gathered with `full_tensor()` as they stream. `metadata()` runs one extra pass the first time
    it is needed and caches the result.
    """

    def __init__(self, named_tensors: NamedTensors) -> None:
        self._named_tensors = named_tensors
        self._metadata: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._metadata is None:
            self._metadata = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._named_tensors()]
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named_tensors():
            yield name, materialize_full_tensor(tensor)


class NCCLWeightSender:
    """Trainer side of vLLM's NCCL weight transfer (vllm.distributed.weight_transfer.nccl_engine).

    Args:
        named_tensors: yields the policy's HF checkpoint-format tensors (on the trainer's GPU).
        client: the engine's weight-sync control plane (HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient, or any
            object with init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update).
        master_address, master_port: TCP rendezvous of the transfer group (the trainer's rank 0 host).
        world_size: 1 (the sending trainer rank) + number of engine workers.
        rank: this trainer rank; rank 0 sends, others only join the gathers of sharded parameters.
        reset_prefix_cache: drops the engine's cached prefixes after each transfer (vLLM's finish_weight_update does
            not, and stale KV/SSM states would otherwise be reused).
    """

    def __init__(
        self,
        named_tensors: NamedTensors,
        *,
        client: VLLMWeightSyncClient,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        reset_prefix_cache: Callable[[], None],
    ) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if world_size < 2:
            raise ValueError(
                f"`world_size` must count the trainer sender and at least one engine worker, got {world_size}"
            )
        init_info = NCCLTrainerInitInfo(
            master_address=master_address, master_port=master_port, world_size=world_size, rank=rank
        )
        self.rank = rank
        self._reset_prefix_cache = reset_prefix_cache
        self._transfer = WeightTransferTrainerFactory.trainer_init(
            init_info, client=client, source=NamedTensorSource(named_tensors)
        )

    def send(self) -> None:
        """Broadcast all tensors, let the engine finish its layerwise reload, then reset its prefix cache."""
        self._transfer.send_weights()
        if self.rank == 0:
            self._reset_prefix_cache()
