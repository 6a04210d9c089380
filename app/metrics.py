"""The job's metrics: the scalars of a step (rollout, plan, training), the console lines that summarise them, and
their TensorBoard log (scalars per step and rollout-tree pictures).

Each fresh run writes `<log_dir>/<run name>` (a timestamp); a resumed run reopens its own folder and drops events
logged after the checkpoint it resumes from (`purge_step`), so curves continue without duplicates.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from rollout.tree import RolloutTree

__all__ = ["MetricsLog", "new_run_name", "rollout_scalars", "engine_scalars", "sync_scalars", "plan_scalars",
           "sft_scalars", "train_scalars", "sft_line", "rl_line", "offline_line", "reward_summary"]


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


class MetricsLog:
    def __init__(self, log_dir: str | Path, run_name: str, purge_step: int | None = None) -> None:
        self.path = Path(log_dir) / run_name
        self.writer = SummaryWriter(str(self.path), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def image(self, tag: str, step: int, image: Image.Image) -> None:
        self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def rollout_scalars(trees: list[RolloutTree], trajectories) -> dict[str, float]:
    """Rewards, sizes and sharing of one RL step's rollout trees."""
    rewards = np.array([t.reward for t in trajectories])
    tree_tokens = sum(t.num_tree_tokens() for t in trees)
    flat_tokens = sum(t.num_flat_tokens() for t in trees)
    trained = sum(int(t.loss_mask.sum()) for t in trajectories)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/trees_solved": float(np.mean([max(t.reward for t in tree.trajectories()) > 0 for tree in trees])),
        "rollout/trajectories": float(len(trajectories)),
        "rollout/tree_tokens": float(tree_tokens),
        "rollout/flat_tokens": float(flat_tokens),
        "rollout/compression": flat_tokens / max(tree_tokens, 1),
        "rollout/generated_tokens_mean": trained / max(len(trajectories), 1),
        "rollout/turns_mean": float(np.mean([t.extra["turns"] for t in trajectories])),
        "rollout/prefix_cache_tokens": float(sum(n.cached_tokens for tree in trees for n in tree.nodes)),
    }


def engine_scalars(seconds: list[float], tokens: list[int]) -> dict[str, float]:
    """The engines' rollouts of one step (one entry per engine, in engine order): the slowest engine's seconds, the
    spread between the slowest and the fastest (how long the fastest waited), and each engine's sampled tokens per
    second (`rollout/tokens_per_s/engine_K`) with their mean."""
    rates = [n / max(s, 1e-9) for n, s in zip(tokens, seconds, strict=True)]
    values = {"rollout/engine_seconds_max": max(seconds), "rollout/engine_seconds_spread": max(seconds) - min(seconds),
              "rollout/tokens_per_s_engine_mean": float(np.mean(rates)), "rollout/engines": float(len(seconds))}
    values.update({f"rollout/tokens_per_s/engine_{k}": rate for k, rate in enumerate(rates)})
    return values


def sync_scalars(nbytes: int, seconds: float) -> dict[str, float]:
    """One weight sync into an engine: gigabytes handed over and their rate (its seconds: `time/weight_sync`)."""
    return {"sync/gigabytes": nbytes / 1e9, "sync/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9)}


def plan_scalars(step: dict[str, float], planner_seconds: float) -> dict[str, float]:
    """The whole step's plan (`step`: sums over replicas, `parallel.metrics.reduce_step`)."""
    return {
        "train/microbatches": step["microbatches"],
        "train/compact_tokens": step["compact_rows"],
        "train/semantic_tokens": step["semantic_tokens"],
        "train/compression": step["compression"],
        "train/linear_attention_calls": step["linear_attention_calls"],
        "train/flat_microbatches": step["flat_microbatches"],
        "time/planner": planner_seconds,
    }


def sft_scalars(step: dict[str, float]) -> dict[str, float]:
    """An SFT step's loss terms, per trained token where they are sums."""
    n = max(step["trained_tokens"], 1.0)
    return {"sft/loss": step["loss"], "sft/nll": step["nll_sum"] / n, "sft/entropy": step["entropy_sum"] / n,
            "sft/router_loss": step["router_loss"]}


def train_scalars(step: dict[str, float], grad_norm: float | None,
                  expert_counts: list[torch.Tensor | None]) -> dict[str, float]:
    """An RL step's loss terms and diagnostics per trained token, its gradient norm, and the MoE layers' loads
    (`expert_counts`: per layer the step's `[E]` loads, None for dense layers)."""
    n = max(step["trained_tokens"], 1.0)
    values = {
        "train/loss": step["loss"],
        "train/policy_loss": step["policy"],
        "train/kl": step["kl"],
        "train/router_loss": step["router_loss"],
        "train/entropy": step["entropy_sum"] / n,
        "train/clip_fraction": step["clipped"] / n,
        "train/tis_weight_mean": step["tis_weight_sum"] / n,
    }
    if grad_norm is not None:
        values["train/grad_norm"] = grad_norm
    if "mismatch_abs_sum" in step:
        values["mismatch/abs_mean"] = step["mismatch_abs_sum"] / n
        values["mismatch/mean"] = step["mismatch_sum"] / n
    moe = [c for c in expert_counts if c is not None]
    if moe:
        loads = torch.stack([c / c.mean().clamp(min=1e-9) for c in moe])
        values["moe/max_load"] = float(loads.max())
        values["moe/mean_max_load"] = float(loads.max(dim=1).values.mean())
    return values


def sft_line(step: int, steps: int, values: dict[str, float]) -> str:
    """The console line of SFT step `step` (1-based) of `steps`."""
    nan = math.nan
    return (f"SFT step {step:>3}/{steps}  nll {values.get('sft/nll', nan):.3f}  "
            f"entropy {values.get('sft/entropy', nan):.3f}  {values['time/step']:.1f} s")


def rl_line(step: int, steps: int, values: dict[str, float]) -> str:
    """The console line of RL step `step` (1-based) of `steps`."""
    nan = math.nan
    return (f"RL step {step:>3}/{steps}  reward {values['rollout/reward_mean']:.3f}  "
            f"solved {values['rollout/trees_solved']:.2f}  loss {values.get('train/loss', nan):+.4f}  "
            f"entropy {values.get('train/entropy', nan):.3f}  |dlogp| {values.get('mismatch/abs_mean', nan):.4f}  "
            f"S/C {values.get('train/compression', nan):.2f}  "
            f"rollout {values['rollout/engine_seconds_max']:.1f} s (+-{values['rollout/engine_seconds_spread']:.1f}, "
            f"{values['rollout/tokens_per_s_engine_mean']:.0f} tok/s/engine)  "
            f"sync {values['time/weight_sync']:.2f} s ({values.get('sync/gb_per_s', nan):.2f} GB/s)  "
            f"{values['time/step']:.1f} s")


def offline_line(step: int, steps: int, values: dict[str, float], prefix: str) -> str:
    """The console line of offline step `step` (1-based) of `steps`; `prefix` is the objective's tag prefix ("sft"
    or "train")."""
    nan = math.nan
    line = (f"offline step {step:>3}/{steps}  loss {values.get(f'{prefix}/loss', nan):+.4f}  "
            f"entropy {values.get(f'{prefix}/entropy', nan):.3f}")
    if prefix == "sft":
        line += f"  nll {values.get('sft/nll', nan):.3f}"
    else:
        line += f"  |dlogp| {values.get('mismatch/abs_mean', nan):.4f}"
    return line + f"  S/C {values.get('train/compression', nan):.2f}  {values['time/step']:.1f} s"


def reward_summary(rewards: list[tuple[int, float]]) -> str | None:
    """Mean reward of the first and the last k (<= 5) RL steps of `(step, reward)` pairs; None for fewer than 2."""
    if len(rewards) < 2:
        return None
    k = max(1, min(5, len(rewards) // 2))
    first, last = rewards[:k], rewards[-k:]
    return (f"mean reward: RL steps {first[0][0]}-{first[-1][0]} {np.mean([r for _, r in first]):.3f}, "
            f"RL steps {last[0][0]}-{last[-1][0]} {np.mean([r for _, r in last]):.3f}")
