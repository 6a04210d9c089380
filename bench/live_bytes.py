"""`LiveBytes`: the most bytes of CPU tensor storage allocated inside a `with` block and alive at once.

A dispatch mode sees every op of the block (functional collectives included: DTensor gathers run through them);
an op output that does not alias an input (its schema return has no alias info) is a fresh allocation, counted
until its storage is freed (a weakref finalizer on the storage: the storage object lives as long as any view of it).
Memory that existed before the block (parameters, an engine's weights) is not counted; views and in-place writes
into it are not allocations.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Attributes: `live` (bytes allocated in the block and still alive), `peak` (their maximum)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [r.alias_info is None for r in func._schema.returns]
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for is_fresh, tensor in zip(fresh, outputs):
            for t in tree_leaves(tensor):
                if not (is_fresh and type(t) is torch.Tensor and t.device.type == "cpu"):
                    continue
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or key in self._alive:
                    continue
                self._alive.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, nbytes)
        return out
