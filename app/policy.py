"""The policy the job trains: a HybridForCausalLM from a preset (random) or a Hugging Face checkpoint, and its
tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.config import ModelSection
from app.errors import ConfigError
from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.hf_io import HFCheckpointError, check_hf, load_hf
from models.presets import PRESETS, preset
from rollout.tokenizer import build_char_tokenizer

__all__ = ["architecture", "build_policy", "build_tokenizer", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if available else cpu; "cuda" without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`train.device` = 'cuda' but torch sees no CUDA device: use 'cpu' or 'auto'")
    return torch.device(name)


@contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """A fault of the `model.hf_path` checkpoint (HFCheckpointError, naming the file and tensor) as a ConfigError."""
    try:
        yield
    except HFCheckpointError as e:
        raise ConfigError(f"`model.hf_path`: {e}") from None


def architecture(config: ModelSection) -> ModelConfig:
    """The policy's architecture without building it: the preset with the `[model]` overrides, or `hf_path`'s
    config.json, once the checkpoint passes `models.hf_io.check_hf` (raises ConfigError naming the key)."""
    if config.hf_path is not None:
        with _checkpoint_errors():
            return dataclasses.replace(check_hf(config.hf_path).config, dtype=config.dtype)
    if config.preset not in PRESETS:
        raise ConfigError(f"`model.preset` must be one of {sorted(PRESETS)}, got {config.preset!r}")
    overrides: dict = dict(dtype=config.dtype)
    for name in ("vocab_size", "hidden_size"):
        if getattr(config, name) is not None:
            overrides[name] = getattr(config, name)
    try:
        return dataclasses.replace(preset(config.preset), **overrides)
    except ValueError as e:
        raise ConfigError(f"[model] {e}") from None


def build_tokenizer(config: ModelSection, vocab_size: int) -> PreTrainedTokenizerBase:
    """`hf_path`'s tokenizer, or the character tokenizer padded to `vocab_size` (the architecture's)."""
    if config.hf_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(config.hf_path)
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"`model.hf_path`: the tokenizer in {config.hf_path} has no eos token (it ends turns)")
        if len(tokenizer) > vocab_size:
            raise ConfigError(f"`model.hf_path`: tokenizer has {len(tokenizer)} tokens but the model only {vocab_size}")
        return tokenizer
    try:
        return build_char_tokenizer(vocab_size)
    except ValueError as e:
        raise ConfigError(f"`model.vocab_size`: {e}") from None


def build_policy(config: ModelSection, seed: int) -> tuple[HybridForCausalLM, PreTrainedTokenizerBase]:
    """The initial policy (on CPU) and its tokenizer.

    A preset is initialised with `torch.manual_seed(seed)` and gets the character tokenizer padded to its vocabulary;
    its bos/eos/pad ids are written into the model config so that exported checkpoints (and vLLM) agree.
    """
    arch = architecture(config)
    tokenizer = build_tokenizer(config, arch.vocab_size)
    if config.hf_path is not None:
        with _checkpoint_errors():
            return load_hf(config.hf_path, dtype=config.dtype), tokenizer
    arch = dataclasses.replace(arch, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return HybridForCausalLM(arch), tokenizer
