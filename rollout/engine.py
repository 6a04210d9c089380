"""The inference-engine interface the rollout builder talks to: token ids in, token ids and log-probs out.

An engine never sees text. Each request is one tree node's prefix submitted once with `n` children (prefix caching
makes the siblings share its prefill); the engine returns the exact sampled ids and their behaviour log-probs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["EngineError", "GenerationRequest", "Completion", "GenerationResult", "Engine"]


class EngineError(RuntimeError):
    """The inference engine failed (generation, weight update, sleep/wake). The app catches this to stop cleanly
    with its last checkpoint intact; the original exception is chained as `__cause__`."""


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt continued `n` times."""

    prompt_token_ids: Sequence[int]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: exact token ids, the behaviour log-prob of each, and why it stopped
    ("stop": a stop token was sampled and is included; "length": max_new_tokens reached)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str


@dataclass(frozen=True)
class GenerationResult:
    """The `n` completions of one request, in sample order, and how many prompt tokens came from the prefix cache."""

    completions: list[Completion]
    num_cached_tokens: int


class Engine(ABC):
    """A rollout engine holding the current policy weights."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids the model accepts; valid ids are [0, vocab_size)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest sequence (prompt + generated) the engine accepts."""

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve all requests as one batch; results in request order. Raises EngineError on failure."""

    @abstractmethod
    def reseed(self, seed: int) -> None:
        """Restart the sampling of requests without their own seed from `seed`, so that a rollout started with the
        same seed, weights and requests samples the same tokens again (where the engine's batching allows)."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights given as Hugging Face checkpoint-format (name, tensor) pairs, then drop every
        cached prefix computed with the old weights. Raises EngineError on failure."""
