"""DCP checkpoints of a trainer's tensors: a plain or parallelized model (FSDP2, TP, EP, pipeline stages), its
optimizers and an optional KL reference, saved and loaded with torch.distributed.checkpoint (DCP) as one flat dict.

Keys: `model/<fqn>`, `optimizer/state.<fqn>.<name>` (torch's flattened optimizer state dict, FQN-keyed, so DCP
reshards it like the parameters) and `reference/<fqn>`. The <fqn> are the whole model's parameter names
(transformers' names) under every layout, pipeline stages included. DCP reshards on load: a checkpoint written by one
process (plain tensors) loads into FSDP2 / TP / EP shards on N ranks, and back, or under another layout.

Tensors only, so that loading never runs code from a file. DCP stores any non-tensor value with pickle and reads it
back with `torch.load(weights_only=False)`, and its `.metadata` file is a pickle. Hence:
- the optimizers' param-group values (lr, betas, weight decay) are not saved: they come from the live optimizers,
  i.e. from the config of the run that loads;
- `read_metadata` unpickles `.metadata` allowing only DCP's own metadata classes, and refuses a checkpoint with a
  non-tensor entry or a shard file outside its folder (`UnsafeCheckpointError`);
- DCP reads the tensors themselves with `torch.load(weights_only=True)`.

`build_optimizers`: torchtitan's `OptimizersContainer` (AdamW over the DTensor parameters) for the distributed
trainer; torchtitan is imported there only (torch >= 2.13 with triton; see docs/distributed.md).
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from parallel.ranks import distributed, first_found

__all__ = ["TrainingState", "read_metadata", "save_tensors", "saved_tensors", "build_optimizers",
           "UnsafeCheckpointError", "CorruptCheckpointError", "CheckpointMismatchError"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
#: What DCP's `.metadata` pickle refers to (torch 2.13 / 2.14), besides torch dtypes.
_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


class UnsafeCheckpointError(ValueError):
    """Loading the checkpoint could run code from it: a pickled object other than DCP metadata, a non-tensor entry
    (DCP unpickles those), or a file outside the checkpoint folder."""


class CorruptCheckpointError(ValueError):
    """The checkpoint's files are missing, truncated or unreadable."""


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fit the model and optimizers being loaded (other names or shapes)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"it refers to `{module}.{name}`, which DCP metadata never holds (unpickling it "
                                    "could run code)")


def read_metadata(folder: str | Path) -> Metadata:
    """`folder/.metadata`, unpickled with DCP's metadata classes only, after checking that every entry is a tensor
    and that every shard file it names is in `folder` and long enough.

    Raises:
        UnsafeCheckpointError: anything else in the pickle, a non-tensor entry or a file outside `folder`.
        CorruptCheckpointError: `.metadata` missing or unreadable, a shard file missing or truncated.
    """
    folder = Path(folder)
    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{path}: {e}") from None
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing") from None
    except Exception as e:
        raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"{path}: entry {key!r} is not a tensor (DCP would unpickle it)")
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        if not _SHARD_FILE.match(name) or info.transform_descriptors:
            raise UnsafeCheckpointError(f"{path}: names the file {name!r} (with transforms "
                                        f"{info.transform_descriptors}); DCP shard files are __R_I.distcp")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = folder / name
        if not file.is_file():
            raise CorruptCheckpointError(f"shard file {file} is missing")
        if file.stat().st_size < size:
            raise CorruptCheckpointError(f"shard file {file} is truncated ({file.stat().st_size} of {size} bytes)")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TrainingState:
    """`model`, its `optimizers` and an optional `reference` model (same names as `model`) as one flat DCP dict.

    `save_tensors(state.tensors(), folder)` writes it; `load(folder)` reads it back. Both are collectives under a
    process group (every rank writes / reads its shards; rank 0 writes `.metadata`)."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 reference: nn.Module | None = None) -> None:
        self.model = model
        self.optimizers = list(optimizers)
        self.reference = reference

    def _live(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Model, flattened optimizer (with its non-tensor param-group values) and reference state dicts; their
        tensors are the live ones. An optimizer without state yet gets it from a zero step at lr 0 (torch's
        `_init_optim_state`: parameters unchanged)."""
        reference = {} if self.reference is None else get_model_state_dict(self.reference)
        return (get_model_state_dict(self.model), get_optimizer_state_dict(self.model, self.optimizers, options=_FLAT),
                reference)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The flat dict to save: live tensors (DTensors under FSDP2 / TP / EP)."""
        return _flat(*self._live())

    def load(self, folder: str | Path) -> None:
        """Load `folder` into the model, optimizers and reference.

        Raises (on every rank alike):
            UnsafeCheckpointError, CorruptCheckpointError: from `read_metadata`.
            CheckpointMismatchError: a tensor missing from the checkpoint, or of another shape.
            torch.distributed.checkpoint.api.CheckpointException: reading a shard failed.
        """
        model, optimizer, reference = self._live()
        destination = _flat(model, optimizer, reference)
        try:
            problem: Exception | None = _mismatch(destination, read_metadata(folder), folder)
        except (UnsafeCheckpointError, CorruptCheckpointError) as e:
            problem = e
        problem = first_found(problem)
        if problem is not None:
            raise problem
        # In place: the three state dicts hold the destination's tensors.
        with _quiet():
            dcp.load(destination, storage_reader=_SafeReader(str(folder)), no_dist=not distributed())
        set_model_state_dict(self.model, model)
        set_optimizer_state_dict(self.model, self.optimizers, optimizer, options=_FLAT)
        if self.reference is not None:
            set_model_state_dict(self.reference, reference)


def _flat(model: dict[str, Any], optimizer: dict[str, Any], reference: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v for k, v in model.items()}
    flat.update({f"optimizer/{k}": v for k, v in optimizer.items() if isinstance(v, torch.Tensor)})
    flat.update({f"reference/{k}": v for k, v in reference.items()})
    return flat


def _mismatch(destination: dict[str, torch.Tensor], metadata: Metadata,
              folder: str | Path) -> CheckpointMismatchError | None:
    saved = metadata.state_dict_metadata
    missing = [k for k in destination if k not in saved]
    if missing:
        return CheckpointMismatchError(f"{folder} has no tensor {missing[0]!r} ({len(missing)} of {len(destination)} "
                                       "missing)")
    for key, tensor in destination.items():
        if tuple(tensor.shape) != tuple(saved[key].size):
            return CheckpointMismatchError(f"{folder}: tensor {key!r} has shape {tuple(saved[key].size)} there, "
                                           f"{tuple(tensor.shape)} here")
    return None


def save_tensors(tensors: dict[str, torch.Tensor], folder: str | Path) -> None:
    """Write `tensors` (a flat dict of tensors / DTensors) as a DCP checkpoint in `folder` (a collective under a
    process group; shard files flushed to disk)."""
    with _quiet():
        dcp.save(tensors, storage_writer=FileSystemWriter(str(folder), sync_files=True), no_dist=not distributed())


def saved_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, on the CPU of this process (for inspection and tests; no process group)."""
    metadata = read_metadata(folder)
    tensors = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for k, md in metadata.state_dict_metadata.items()}
    with _quiet():
        dcp.load(tensors, storage_reader=_SafeReader(str(folder)), no_dist=True)
    return tensors


def build_optimizers(model: nn.Module, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8,
                     implementation: Literal["for-loop", "foreach", "fused"] = "foreach"):
    """torchtitan `OptimizersContainer` with one AdamW group over every trainable parameter."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})
    config = OptimizersContainer.Config(param_groups=[group], implementation=implementation)
    return OptimizersContainer(config, model_parts=[model])
