"""A rollout engine that decodes with the trainer's own model in plain torch (no vLLM).

No KV cache: every new token re-runs the flat packed forward over the whole prefix of every unfinished sequence, so
decoding costs O(L^2) per sequence; meant for tests, debugging and machines without vLLM. In exchange it is exact
(the trainer's dtype and code path, so trainer and behaviour log-probs agree to rounding) and reproducible: a request
with a seed samples child i from a torch.Generator seeded with seed + i (as vLLM does), so rollouts with
`RolloutConfig.seed` set are a function of the weights and the tree ids alone, across processes and resumes;
requests without a seed draw from the engine's own generator (`reseed`).

Weight updates stream: each Hugging Face tensor is held only until the other parts of its parameter arrive (the
experts' per-expert matrices of one `[E, 2F, D]` entry), then merged into the parameter, so an update holds at most
one parameter's parts beside the engine's own model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from models.decoder import HybridForCausalLM
from models.hf_io import key_rule
from rollout.engine import Completion, Engine, EngineError, GenerationRequest, GenerationResult

__all__ = ["TorchEngine"]


@dataclass
class _Sequence:
    prompt: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    temperature: float
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


class TorchEngine(Engine):
    """Decodes with a private copy of `model` (updated by `update_weights`).

    Args:
        model: the policy; it is deep-copied, so the trainer's updates reach the engine only through update_weights.
        max_model_len: longest prompt + generation.
        seed: seed of the generator used by requests without a seed.
    """

    def __init__(self, model: HybridForCausalLM, max_model_len: int, seed: int = 0) -> None:
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._max_model_len = max_model_len
        self.reseed(seed)
        self.weight_version = 0
        # On-disk name -> (our state-dict key, its part index), and each key's number of parts.
        self._parts: dict[str, tuple[str, int]] = {}
        self._counts: dict[str, int] = {}
        for key, ref in self.model.state_dict().items():
            names = key_rule(self.model.config, key, ref.shape).disk_keys
            self._counts[key] = len(names)
            self._parts.update((name, (key, i)) for i, name in enumerate(names))

    def reseed(self, seed: int) -> None:
        """Restart the generator of requests without a seed from `seed`."""
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def _sequences(self, request: GenerationRequest) -> list[_Sequence]:
        if request.top_p != 1.0:
            raise NotImplementedError(
                f"TorchEngine samples the full distribution: top_p must be 1, got {request.top_p}"
            )
        prompt = [int(t) for t in request.prompt_token_ids]
        if len(prompt) >= self._max_model_len:
            raise EngineError(f"TorchEngine: prompt of {len(prompt)} tokens leaves no room in max_model_len "
                              f"{self._max_model_len}")
        out = []
        for i in range(request.n):
            if request.seed is None:
                generator = self._generator
            else:
                generator = torch.Generator(device="cpu").manual_seed(request.seed + i)
            out.append(_Sequence(prompt, min(request.max_new_tokens, self._max_model_len - len(prompt)),
                                 frozenset(request.stop_token_ids), request.temperature, generator))
        return out

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Sample every request's n continuations, all unfinished sequences in one forward per token."""
        per_request = [self._sequences(r) for r in requests]
        active = [s for seqs in per_request for s in seqs]
        device = next(self.model.parameters()).device
        while active:
            ids = [s.prompt + s.tokens for s in active]
            lengths = torch.tensor([len(x) for x in ids])
            cu = torch.zeros(len(ids) + 1, dtype=torch.long)
            cu[1:] = lengths.cumsum(0)
            flat = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=device)
            hidden = self.model.hidden_states(flat, cu_seqlens=cu.to(device)).hidden[cu[1:].to(device) - 1]
            logits = (hidden @ self.model.lm_head_weight.T).to(torch.float64)
            for s, row in zip(active, logits):
                logp = torch.log_softmax(row / s.temperature, dim=-1).cpu()
                token = int(torch.multinomial(logp.exp(), 1, generator=s.generator))
                s.tokens.append(token)
                s.logprobs.append(float(logp[token]))
                if token in s.stop:
                    s.finish_reason = "stop"
                elif len(s.tokens) >= s.max_new_tokens:
                    s.finish_reason = "length"
            active = [s for s in active if s.finish_reason is None]
        return [
            GenerationResult([Completion(tuple(s.tokens), tuple(s.logprobs), s.finish_reason) for s in seqs], 0)
            for seqs in per_request
        ]

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face checkpoint-format tensors (models.hf_io.checkpoint_tensors' names) into the private model,
        each parameter as soon as all its parts arrived. An unknown name, or a parameter left without all its parts,
        raises EngineError (the parameters loaded before it keep their new values)."""
        state = self.model.state_dict()
        waiting: dict[str, dict[int, torch.Tensor]] = {}
        done = set()
        for name, tensor in named_tensors:
            if name not in self._parts:
                raise EngineError(f"TorchEngine weight update {self.weight_version + 1}: unknown tensor {name!r}")
            key, i = self._parts[name]
            parts = waiting.setdefault(key, {})
            parts[i] = tensor
            if len(parts) == self._counts[key]:
                ref = state[key]
                rule = key_rule(self.model.config, key, ref.shape)
                ref.copy_(rule.merge([parts[j] for j in range(len(parts))]))
                del waiting[key]
                done.add(key)
        missing = [name for name, (key, i) in self._parts.items() if key not in done and i not in waiting.get(key, {})]
        if missing:
            raise EngineError(f"TorchEngine weight update {self.weight_version + 1}: no tensor {missing[0]!r}")
        self.weight_version += 1
