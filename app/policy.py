"""The policy the job trains: a HybridForCausalLM from a preset (random) or a Hugging Face checkpoint, and its
tokenizer."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.config import ModelConfig
from app.config_loader import ConfigError
from models.decoder import HybridForCausalLM
from models.hf_io import load_hf
from models.presets import PRESETS, preset
from rollout.tokenizer import build_char_tokenizer

__all__ = ["build_policy", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if available else cpu; "cuda" without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`train.device` = 'cuda' but torch sees no CUDA device: use 'cpu' or 'auto'")
    return torch.device(name)


def build_policy(config: ModelConfig, seed: int) -> tuple[HybridForCausalLM, PreTrainedTokenizerBase]:
    """The initial policy (on CPU) and its tokenizer.

    A preset is initialised with `torch.manual_seed(seed)` and gets the character tokenizer padded to its vocabulary;
    its bos/eos/pad ids are written into the model config so that exported checkpoints (and vLLM) agree.
    """
    if config.hf_path is not None:
        model = load_hf(config.hf_path, dtype=config.dtype)
        tokenizer = AutoTokenizer.from_pretrained(config.hf_path)
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"`model.hf_path`: the tokenizer in {config.hf_path} has no eos token (it ends turns)")
        if len(tokenizer) > model.config.vocab_size:
            raise ConfigError(
                f"`model.hf_path`: tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}"
            )
        return model, tokenizer
    if config.preset not in PRESETS:
        raise ConfigError(f"`model.preset` must be one of {sorted(PRESETS)}, got {config.preset!r}")
    architecture = preset(config.preset)
    vocab_size = config.vocab_size or architecture.vocab_size
    try:
        tokenizer = build_char_tokenizer(vocab_size)
    except ValueError as e:
        raise ConfigError(f"`model.vocab_size`: {e}") from None
    overrides = dict(
        vocab_size=vocab_size, dtype=config.dtype, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if config.hidden_size is not None:
        overrides["hidden_size"] = config.hidden_size
    torch.manual_seed(seed)
    return HybridForCausalLM(dataclasses.replace(architecture, **overrides)), tokenizer
