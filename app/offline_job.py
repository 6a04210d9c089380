"""The offline job (`[job] kind = "offline"`): train on recorded trajectories instead of rollouts.

    step   `train.trees_per_step` whole trees (or `train.trajectories_per_step` records of one-path trees) of
           `[data] trajectories` (app.data: seeded shuffle of trees, epochs, prefetch, bad records, the position in
           every checkpoint) -> microbatch plan in `planner.mode` -> tree execution -> SFT NLL, or the `[rl]`
           objective on the recorded advantages -> AdamW

The job base runs it (app.job.Job, shared with the RL job): one process or every rank of a torchrun launch, the main
rank reads the step's records and plans them for the D data-parallel replicas (the records' order therefore does
not depend on the number of ranks), the same checkpoints, --resume, stop signals, skipped steps, TensorBoard run,
progress bars and HF export. No rollout engine and no environment are started.

Objectives (`job.objective`): "sft" trains the loss_mask tokens with the RL job's SFT loss (token-mean NLL times each
record's `weight`; tags `sft/`); "rl" runs `[rl]`'s objective as an RL step does (app.job.Job._policy_updates:
`rl.epochs` updates against the trainer's own old log-probs, truncated IS with the recorded behaviour `logprobs`
at `rollout.temperature`, KL to the recorded `ref_logprobs`; tags `train/`) with the recorded advantages as they
are (no GRPO grouping). A record lacking a field the objective needs, or with a path longer than the model's
`max_position_embeddings` (or, in duplicate mode, `planner.capacity`), is a bad record (app.data.trajectories).

The run ends after `train.steps` steps, or earlier (final checkpoint and export) when the trees of `data.epochs`
epochs hold fewer steps: it runs as many as they hold and says so (a skipped bad record can end the last epoch a
step earlier, which ends the run the same way).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console

from app.config import JobConfig
from app.data import RecordFeed, build_trajectory_feed, path_limits
from app.errors import ConfigError
from app.job import Job, SharedBatch
from app.losses import sft_loss
from app.metrics import offline_line, plan_scalars, sft_scalars, train_scalars
from app.progress import JobProgress
from models.config import ModelConfig
from planner.microbatch.plan import check_inputs
from planner.step_plan import longest_trajectory
from planner.trajectory import Trajectory

__all__ = ["run_offline", "OfflineProgress"]


@dataclass
class OfflineProgress:
    """Completed offline steps (what a checkpoint records)."""

    offline_done: int = 0

    @property
    def step(self) -> int:
        return self.offline_done

    def __str__(self) -> str:
        return f"offline steps done {self.offline_done}"


def record_scalars(trees: list[list[Trajectory]], feed_state: dict) -> dict[str, float]:
    """The step's trees: how many, how many records, their recorded rewards (when every one has one), the data
    position."""
    trajectories = [t for tree in trees for t in tree]
    values = {"data/trees": float(len(trees)), "data/records": float(len(trajectories)),
              "data/epoch": float(feed_state["epoch"]), "data/skipped": float(feed_state["skipped"])}
    rewards = [t.reward for t in trajectories]
    if all(r is not None for r in rewards):
        values["data/reward_mean"] = float(np.mean(rewards))
    return values


class OfflineJob(Job):
    """Steps of recorded trees: no environment, no engine."""

    Progress = OfflineProgress
    record_kind = "trajectory record"

    def make_environment(self, tokenizer) -> None:
        return None

    def make_feed(self, model: ModelConfig, environment: None) -> RecordFeed:
        """(main rank) The trees of `[data] trajectories`, their paths checked against `model`'s limits."""
        c = self.config
        limits = path_limits(model.max_position_embeddings, c.planner.capacity, c.plan_mode)
        return build_trajectory_feed(c.data, c.job.objective, c.rl, vocab_size=model.vocab_size, limits=limits,
                                     seed=c.train.seed, whole_trees=c.train.trees_per_step is not None,
                                     on_skip=self._print)

    def _per_step(self) -> int:
        """Feed units (trees) a step takes."""
        c = self.config.train
        return c.trajectories_per_step if c.trees_per_step is None else c.trees_per_step

    def _records(self, step: int) -> SharedBatch:
        """(main rank) Offline step `step` (0-based): its trees' records, planned for the D replicas."""
        c = self.config
        trees = self.data.next_batch(self._per_step(), step + 1)
        trajectories = [t for tree in trees for t in tree]
        try:  # paths longer than a microbatch were refused as bad records (app.data.trajectories.path_limits)
            split = longest_trajectory(c.plan_mode, c.planner.capacity) is None
            check_inputs(trajectories, c.planner.capacity, self.trainer.dp, split_paths=split)
        except ValueError as e:
            raise ConfigError(f"planner.mode = {c.plan_mode!r}, the records of step {step + 1}: {e}") from None
        return self._planned(trajectories, record_scalars(trees, self.data.stream.state_dict()))

    def _total_steps(self) -> tuple[int, str | None]:
        """(main rank) `train.steps`, or fewer when the trees of `data.epochs` epochs hold fewer steps, with the line
        that says so."""
        c = self.config
        stream = self.data.stream
        if stream.epochs is None:
            return c.train.steps, None
        held = stream.epochs * stream.units_per_epoch // self._per_step()
        if held >= c.train.steps:
            return c.train.steps, None
        return held, (f"data: the {stream.epochs} epoch(s) of {stream.units_per_epoch} {self.data.records} hold "
                      f"{held} steps of {self._per_step()} {self.data.items} (`train.steps` = {c.train.steps}); "
                      f"stopping after step {held}")

    def phases(self, bars: JobProgress) -> None:
        total, note = self.trainer.share(self._total_steps)
        if self.done.offline_done < total:
            self._steps(bars, total)
        if note is not None:
            self._print(note)

    def _steps(self, bars: JobProgress, total: int) -> None:
        """Offline steps from `self.done` to `total`."""
        c = self.config
        sft = c.job.objective == "sft"
        prefix = "sft" if sft else "train"
        task = bars.phase("offline", total, self.done.offline_done)
        every = max(1, total // 10)
        for s in range(self.done.offline_done, total):
            start = time.perf_counter()
            shared = self.trainer.share(lambda: self._records(s))
            label = f"offline step {s + 1}"
            with self.first_step.step("offline", label):
                if sft:
                    microbatches = self._prepare(shared, "token-mean")
                    update = self._update(microbatches, sft_loss(self.router), self._lr(c.train.lr, s), 1.0, label)
                else:
                    update, _ = self._policy_updates(shared, s, label, bars)
            self.done.offline_done = s + 1
            values = {**shared.scalars, f"{prefix}/lr": update.lr, f"{prefix}/skipped": float(update.skipped),
                      "time/forward": update.metrics.forward_seconds,
                      "time/backward": update.metrics.backward_seconds,
                      "time/optimizer": update.optimizer_seconds, "time/step": time.perf_counter() - start}
            if math.isfinite(update.step["loss"]):
                values.update(plan_scalars(update.step, shared.planner_seconds))
                values.update(sft_scalars(update.step) if sft else
                              train_scalars(update.step, update.grad_norm, update.expert_counts))
            if sft and update.grad_norm is not None:
                values["sft/grad_norm"] = update.grad_norm
            due = (s + 1) % every == 0 or s + 1 == total
            self._end_step(bars, task, values, f"loss {values.get(f'{prefix}/loss', float('nan')):+.4f}",
                           offline_line(s + 1, total, values, prefix) if due else None, update.skipped)


def run_offline(config: JobConfig, console: Console | None = None) -> int:
    """Run the offline job of `config` in this process (one of the ranks under torchrun); returns the exit code."""
    return OfflineJob.start(config, console)
