"""Load and save Hugging Face checkpoints (config.json + safetensors) of Qwen3NextForCausalLM / KimiLinearForCausalLM.

Our parameter names are transformers 5's in-memory names (see `models.decoder`). On disk, checkpoints use the
original layout, which transformers converts on load and back on save, and which vLLM reads:
  both families   `...mlp.experts.gate_up_proj [E, 2F, D]`  <->  per expert `gate_proj` / `up_proj` `[F, D]`
                  (Kimi-Linear: `w1` / `w3`), `...mlp.experts.down_proj [E, D, F]` <-> per expert `down_proj`
                  (Kimi-Linear: `w2`) `[D, F]`
  Kimi-Linear     MoE layers' `mlp.` <-> `block_sparse_moe.` (dense layers keep `mlp.`, as vLLM expects; on load
                  `block_sparse_moe.` is accepted for them too, which is how transformers' save_pretrained names them); `self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias,
                  A_log}` <-> `self_attn.{...}`; `self_attn.conv1d.weight [3C, 1, W]` <-> `self_attn.{q,k,v}_conv1d.weight`
`checkpoint_tensors(model)` yields the on-disk (name, tensor) pairs without copying, e.g. to stream weights into
vLLM's `load_weights`; `save_hf` writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.dtypes import DTYPES
from models.hf_config import architecture_of, config_from_hf, config_to_hf

#: On-disk tensors that are dropped on load (transformers ignores them too): Qwen3-Next's multi-token-prediction
#: head, and cached rotary tables of older checkpoints.
IGNORED_ON_LOAD = re.compile(r"^mtp\.|rotary_emb\.inv_freq$")


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


def _index_of(path: Path) -> dict[str, Path]:
    """Disk tensor name -> safetensors file, from model.safetensors or model.safetensors.index.json."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


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
    Raises NotImplementedError for other architectures or unsupported options, KeyError for missing or unexpected
    tensors, ValueError for shape mismatches (each naming the tensor).
    """
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    architecture_of(raw)
    config = config_from_hf(raw)
    config.dtype = _resolve_dtype(dtype, raw)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    index = _index_of(path)
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        file = index[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        return handles[file].get_tensor(name)

    used: set[str] = set()
    state = {}
    for key, ref in model.state_dict().items():
        rule = key_rule(config, key, ref.shape)
        found = [next((a for a in _disk_aliases(config, k) if a in index), None) for k in rule.disk_keys]
        missing = [k for k, f in zip(rule.disk_keys, found) if f is None]
        if missing:
            raise KeyError(f"checkpoint {path} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} (for `{key}`)")
        tensor = rule.merge([read(k) for k in found])
        if tensor.shape != ref.shape:
            raise ValueError(
                f"checkpoint tensor {rule.disk_keys[0]!r} gives `{key}` shape {tuple(tensor.shape)}, "
                f"but config.json implies {tuple(ref.shape)}"
            )
        state[key] = tensor.to(ref.dtype)
        used.update(found)
    unexpected = [
        k for k in index
        if k not in used and not IGNORED_ON_LOAD.search(k) and not (config.tie_word_embeddings and k == "lm_head.weight")
    ]
    if unexpected:
        raise KeyError(f"checkpoint {path} has tensors this model does not use: {sorted(unexpected)[:5]}")
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
