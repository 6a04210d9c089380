"""Load and save Hugging Face checkpoints (config.json + safetensors) of Qwen3NextForCausalLM / KimiLinearForCausalLM.

Our parameter names are transformers 5's in-memory names (see `models.decoder`). On disk, checkpoints use the
original layout, which transformers converts on load and back on save, and which vLLM reads:
  both families   `...mlp.experts.gate_up_proj [E, 2F, D]`  <->  per expert `gate_proj` / `up_proj` `[F, D]`
                  (Kimi-Linear: `w1` / `w3`), `...mlp.experts.down_proj [E, D, F]` <-> per expert `down_proj`
                  (Kimi-Linear: `w2`) `[D, F]`
  Kimi-Linear     MoE layers' `mlp.` <-> `block_sparse_moe.` (dense layers keep `mlp.`, as vLLM expects; on load
                  `block_sparse_moe.` is accepted for them too, which is how transformers' save_pretrained names
                  them); `self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}` <-> `self_attn.{...}`;
                  `self_attn.conv1d.weight [3C, 1, W]` <-> `self_attn.{q,k,v}_conv1d.weight`
`checkpoint_tensors(model)` yields the on-disk (name, tensor) pairs without copying, e.g. to stream weights into
vLLM's `load_weights`; `save_hf` writes them. `check_hf` checks a checkpoint folder against its config.json without
reading tensor data (`load_hf` runs it first): every fault is a `HFCheckpointError` naming the file (and tensor) and
the fix.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.dtypes import DTYPES
from models.hf_config import config_from_hf, config_to_hf

#: On-disk tensors that are dropped on load (transformers ignores them too): Qwen3-Next's multi-token-prediction
#: head, and cached rotary tables of older checkpoints.
IGNORED_ON_LOAD = re.compile(r"^mtp\.|rotary_emb\.inv_freq$")
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: The fix of weights that disagree with config.json.
REEXPORT = "the weights do not match config.json; re-export the checkpoint or point `hf_path` at a complete one"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint folder that cannot be loaded; the message names the file (and tensor) and the fix."""


@dataclass
class KeyRule:
    """How one of our tensors is stored on disk: as `disk_keys`, cut by `split`, rebuilt by `merge`."""

    disk_keys: list[str]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    merge: Callable[[list[torch.Tensor]], torch.Tensor]


def _identity(key: str) -> KeyRule:
    return KeyRule([key], lambda t: [t], lambda ts: ts[0])


def key_rule(config: ModelConfig, key: str, shape: torch.Size) -> KeyRule:
    """Disk layout of our state-dict entry `key` of shape `shape`."""
    kimi = config.family == "kimi_linear"
    m = re.match(r"^(model\.layers\.\d+\.)mlp\.(.*)$", key)
    if m and kimi and config.ffn_types[int(key.split(".")[2])] == "moe":
        prefix, rest = m.group(1) + "block_sparse_moe.", m.group(2)
    elif m:
        prefix, rest = m.group(1) + "mlp.", m.group(2)
    else:
        prefix = rest = None
    if rest == "experts.gate_up_proj":
        E, F = shape[0], shape[1] // 2
        gate, up = ("w1", "w3") if kimi else ("gate_proj", "up_proj")
        keys = [f"{prefix}experts.{e}.{gate}.weight" for e in range(E)]
        keys += [f"{prefix}experts.{e}.{up}.weight" for e in range(E)]
        return KeyRule(
            keys,
            lambda t: list(t[:, :F].unbind(0)) + list(t[:, F:].unbind(0)),
            lambda ts: torch.cat((torch.stack(ts[:E]), torch.stack(ts[E:])), dim=1),
        )
    if rest == "experts.down_proj":
        down = "w2" if kimi else "down_proj"
        return KeyRule(
            [f"{prefix}experts.{e}.{down}.weight" for e in range(shape[0])],
            lambda t: list(t.unbind(0)),
            torch.stack,
        )
    if rest is not None:
        return _identity(prefix + rest)
    if kimi:
        key_plain = re.sub(r"\.self_attn\.forget_gate\.", ".self_attn.", key)
        if key_plain != key:
            return _identity(key_plain)
        if key.endswith(".self_attn.conv1d.weight"):
            base = key[: -len("conv1d.weight")]
            return KeyRule(
                [f"{base}{p}_conv1d.weight" for p in "qkv"], lambda t: list(t.chunk(3, dim=0)), torch.cat
            )
    return _identity(key)


def _disk_aliases(config: ModelConfig, name: str) -> list[str]:
    """On-disk names under which tensor `name` may be stored, preferred first."""
    if config.family == "kimi_linear" and ".mlp." in name:
        return [name, name.replace(".mlp.", ".block_sparse_moe.")]
    return [name]


def checkpoint_tensors(model: HybridForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk name, tensor) pairs of the model's weights in Hugging Face checkpoint layout (views, no copies)."""
    for key, tensor in model.state_dict().items():
        rule = key_rule(model.config, key, tensor.shape)
        yield from zip(rule.disk_keys, rule.split(tensor))


@dataclass
class DiskTensor:
    """A tensor of a checkpoint as its safetensors header describes it."""

    file: Path
    shape: tuple[int, ...]


@dataclass
class HFCheckpoint:
    """A checked checkpoint folder: its config.json, the model it describes and how each of our tensors is read."""

    path: Path
    raw: dict
    config: ModelConfig
    #: Our state-dict key -> the on-disk tensors that hold it (the names found in this checkpoint) and their merge.
    sources: dict[str, KeyRule]
    #: On-disk tensor name -> the safetensors file that holds it.
    files: dict[str, Path]


def _read_config(path: Path) -> dict:
    """config.json of checkpoint folder `path` as a dict."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise HFCheckpointError(f"{file} does not exist: a Hugging Face checkpoint folder holds config.json beside its "
                              "safetensors weights") from None
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{file} is not readable JSON ({e}); fix it or re-export the checkpoint") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{file} must hold a JSON object, got {type(raw).__name__}; re-export the checkpoint")
    return raw


def _model_config(path: Path, raw: dict) -> ModelConfig:
    """The ModelConfig of config.json dict `raw` (an unsupported architecture or option names itself)."""
    try:
        return config_from_hf(raw)
    except (NotImplementedError, ValueError, KeyError, TypeError) as e:
        raise HFCheckpointError(f"{path / 'config.json'}: {e}") from None


def _header(file: Path) -> tuple[int, dict]:
    """(where the data section starts, the JSON header) of safetensors file `file`: tensor name -> dtype, shape,
    data_offsets, `__metadata__` left out; only the header is read."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little")
            text = f.read(length) if len(prefix) == 8 and 8 + length <= size else None
    except OSError as e:
        raise HFCheckpointError(f"{file} cannot be read ({e}); make it readable") from None
    if text is None:
        raise HFCheckpointError(f"{file} ({size} bytes) is too short for a safetensors header: it is truncated or "
                              "not a safetensors file; copy it again or re-export the checkpoint")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise HFCheckpointError(f"{file}: its safetensors header does not parse ({e}); copy it again or re-export the "
                              "checkpoint") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{file}: its safetensors header is not a JSON object; re-export the checkpoint")
    header.pop("__metadata__", None)
    return 8 + length, header


def _entry(file: Path, name: str, entry) -> tuple[tuple[int, ...], int]:
    """(shape, end of its data in the data section) of header entry `name` of safetensors file `file`."""
    try:
        return tuple(int(n) for n in entry["shape"]), int(entry["data_offsets"][1])
    except (KeyError, TypeError, ValueError, IndexError):
        raise HFCheckpointError(f"{file}: header entry {name!r} = {entry!r} has no valid `shape` and `data_offsets`; "
                              "re-export the checkpoint") from None


def _tensor_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of safetensors file `file`, which must hold all the data its header names (a truncated
    copy does not) and pass safetensors' own checks; no tensor data is read."""
    data_start, header = _header(file)
    entries = {name: _entry(file, name, entry) for name, entry in header.items()}
    end = data_start + max((stop for _, stop in entries.values()), default=0)
    size = file.stat().st_size
    if size < end:
        raise HFCheckpointError(f"{file} is truncated: it has {size} bytes, its header names tensor data up to byte "
                              f"{end}; copy it again or re-export the checkpoint")
    try:
        with safe_open(file, framework="pt"):  # safetensors' own checks of the header against the file
            pass
    except SafetensorError as e:
        raise HFCheckpointError(f"{file}: safetensors refuses it ({e}); copy it again or re-export the "
                              "checkpoint") from None
    return {name: shape for name, (shape, _) in entries.items()}


def _weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from model.safetensors.index.json `index`."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HFCheckpointError(f"{index} is not a safetensors index with a `weight_map` ({type(e).__name__}: {e}); "
                              "re-export the checkpoint") from None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise HFCheckpointError(f"{index}: `weight_map` must map tensor names to shard file names; re-export the "
                              "checkpoint")
    return weight_map


def _shards(path: Path, index: Path) -> dict[str, DiskTensor]:
    """The tensors of a sharded checkpoint: each shard `index` names must exist and hold the tensors it is named
    for."""
    names_of: dict[str, list[str]] = {}
    for name, file_name in _weight_map(index).items():
        names_of.setdefault(file_name, []).append(name)
    tensors = {}
    for file_name, names in names_of.items():
        file = path / file_name
        if not file.is_file():
            raise HFCheckpointError(f"{index} names shard {file_name} (for {names[0]!r} and {len(names) - 1} more), "
                                    f"but {file} does not exist; copy every shard the index names beside it")
        shapes = _tensor_shapes(file)
        for name in names:
            if name not in shapes:
                raise HFCheckpointError(f"{index} places tensor {name!r} in {file}, which does not hold it; re-export "
                                      "the checkpoint")
            tensors[name] = DiskTensor(file, shapes[name])
    return tensors


def _disk_tensors(path: Path) -> tuple[Path, dict[str, DiskTensor]]:
    """(the file that lists the tensors: model.safetensors or the index, on-disk name -> tensor) of folder `path`."""
    index, single = path / INDEX, path / SINGLE_FILE
    if index.exists():
        return index, _shards(path, index)
    if not single.is_file():
        raise HFCheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX}: put the checkpoint's safetensors "
                              "weights beside its config.json")
    return single, {name: DiskTensor(single, shape) for name, shape in _tensor_shapes(single).items()}


def _source(config: ModelConfig, key: str, ref: torch.Tensor, listing: Path, disk: dict[str, DiskTensor]) -> KeyRule:
    """How our tensor `key` (meta tensor `ref`) is read from `disk`: each of its on-disk parts (under one of its
    aliases) must be there with the shape config.json implies."""
    rule = key_rule(config, key, ref.shape)
    names = []
    for disk_key, part in zip(rule.disk_keys, rule.split(ref)):
        name = next((a for a in _disk_aliases(config, disk_key) if a in disk), None)
        ours = "" if disk_key == key else f" (our `{key}`)"
        if name is None:
            raise HFCheckpointError(f"{listing} lacks tensor {disk_key!r}{ours}; {REEXPORT}")
        if disk[name].shape != tuple(part.shape):
            raise HFCheckpointError(f"{disk[name].file}: tensor {name!r}{ours} has shape {disk[name].shape}, but "
                                  f"config.json implies {tuple(part.shape)}; {REEXPORT}")
        names.append(name)
    return dataclasses.replace(rule, disk_keys=names)


def check_hf(path: str | Path) -> HFCheckpoint:
    """Check Hugging Face checkpoint folder `path` without reading tensor data: config.json parses and describes a
    supported model; model.safetensors, or every shard that model.safetensors.index.json names, exists, its header
    parses and the file holds all the data the header names; the tensors are exactly the model's (besides
    `IGNORED_ON_LOAD`), in the shapes config.json implies. Raises HFCheckpointError naming the file (and tensor)."""
    path = Path(path)
    raw = _read_config(path)
    config = _model_config(path, raw)
    listing, disk = _disk_tensors(path)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    sources = {key: _source(config, key, ref, listing, disk) for key, ref in model.state_dict().items()}
    used = {name for rule in sources.values() for name in rule.disk_keys}
    unexpected = sorted(
        name for name in disk
        if name not in used and not IGNORED_ON_LOAD.search(name)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise HFCheckpointError(f"{disk[unexpected[0]].file} has tensor {unexpected[0]!r}{more}, which the model of "
                              f"config.json does not use; {REEXPORT}")
    return HFCheckpoint(path, raw, config, sources, {name: disk[name].file for name in used})


def _resolve_dtype(dtype: torch.dtype | str | None, raw: dict) -> str:
    if dtype is None:
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(DTYPES)}, got {dtype!r}")
    return name


def load_hf(path: str | Path, dtype: torch.dtype | str | None = None) -> HybridForCausalLM:
    """Build the model of a Hugging Face checkpoint directory and load its weights (on CPU).

    Args:
        path: directory with config.json and model.safetensors (or sharded model-*.safetensors + index).
        dtype: parameter dtype; default: config.json's `dtype` / `torch_dtype`, else float32.
    Raises HFCheckpointError (`check_hf`) for other architectures or unsupported options, missing or unreadable files,
    missing or unexpected tensors and shape mismatches, each naming the file (and tensor).
    """
    checkpoint = check_hf(path)
    config = dataclasses.replace(checkpoint.config, dtype=_resolve_dtype(dtype, checkpoint.raw))
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt"))
                   for file in set(checkpoint.files.values())}
        state = {}
        for key, ref in model.state_dict().items():
            rule = checkpoint.sources[key]
            parts = [handles[checkpoint.files[name]].get_tensor(name) for name in rule.disk_keys]
            state[key] = rule.merge(parts).to(ref.dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_hf(model: HybridForCausalLM, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors (sharded with an index above `max_shard_bytes`) in Hugging Face layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in checkpoint_tensors(model):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        # safetensors refuses views that share storage: store each piece as its own contiguous tensor.
        shards[-1][name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
